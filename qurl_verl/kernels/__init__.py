"""The project's kernel classes for vLLM's own kernel registry (``_POSSIBLE_INT8_KERNELS``), one module per
platform path: ``cpu_int8`` (the vLLM-CPU INT8 classes, one per CPU capability) and ``cpu_int8_paths`` (the
per-sync path each holds: predicates and GEMM calls, no vLLM class). A patch puts the classes in vLLM's list
(``patches.vllm_cpu_worker.vllm_cpu_int8_kernels``); vLLM's selector then picks them as its own."""
