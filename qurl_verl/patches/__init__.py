"""Every work-around of verl or vLLM behaviour, one module each, grouped by when it applies.

| group | applied | by | entry |
|---|---|---|---|
| ``always`` | in every process that imports verl; acts only on configs that use qurl-verl | the plugin | ``always.apply_all(check, prepare)`` |
| ``cpu_platform`` | only with ``VERL_PLATFORM=cpu`` | the plugin | ``cpu_platform.apply_all()`` |
| ``qurl_vllm`` | only in a process that runs the ``qurl_vllm`` rollout adapter | the adapter | ``loss_metrics_channel.apply()`` |
| ``qurl_vllm_server`` | only on a ``qurl_vllm`` server's own engine object | the server | ``qurl_vllm_server.apply_all(engine)`` |
| ``vllm_cpu_worker`` | only inside a ``qurl_vllm`` vLLM worker on a CPU (some only on some CPUs) | the worker extension | ``before_model_load()``, ``after_reload(model)`` |
| ``vllm_worker`` | inside every ``qurl_vllm`` vLLM worker, on every platform | the worker extension | ``vllm_worker.apply_all()`` |
| ``install`` | once, by the install script (``python -m ...``) | the user | the module's ``--install`` |

Each module declares ``PATCH = contract.Patch(...)``: the upstream ``module:qualname`` it changes,
the package versions it was written for, when it applies (a text, and a predicate where that is
decided at run time) and how often it runs; ``PATCH.apply()`` returns what it did ("" = nothing)
and warns once on a version it was not written for. Each group's ``__init__`` lists its patches in
the order they apply. ``contract.wrap_once`` is the one "already applied" guard; ``on_import`` lets
a patch take effect whether or not its upstream module is imported yet. Nothing here imports
``qurl_verl.rollout``. Each module's docstring says what it targets, why it exists and when it does
nothing; each has a test that fails when the upstream behaviour it works around changes.
"""
