"""Every work-around of verl or vLLM behaviour, one module each, grouped by when it applies.

| group | applied | by |
|---|---|---|
| ``always`` | in every process that imports verl; acts only on configs that use qurl-verl | the plugin |
| ``cpu_platform`` | only with ``VERL_PLATFORM=cpu`` | the plugin |
| ``qurl_vllm`` | only in a process that runs the ``qurl_vllm`` rollout adapter | the adapter |
| ``vllm_cpu_worker`` | only inside a ``qurl_vllm`` vLLM worker on a CPU (some only on some CPUs) | the worker extension |
| ``install`` | once, by the install script (``python -m ...``) | the user |

``on_import`` lets a patch take effect whether or not its upstream module is imported yet.
Each module names the versions it targets, why it exists, and when it does nothing; each has a
test that fails when the upstream behaviour it works around changes.
"""
