# Two commands for a fresh machine: `make demo` (the embedded CPU run) and `make test`.
# Each builds or updates .venv first (scripts/install_cpu_stack.sh; a no-op when up to date).
PY := .venv/bin/python
STEPS ?= 3

.PHONY: venv demo test test-unit test-integration test-e2e bench report study clean-outputs

venv:
	@bash scripts/install_cpu_stack.sh

demo: venv
	STEPS=$(STEPS) bash recipes/tiny_cpu/run.sh

test: venv
	$(PY) -m pytest -ra

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

# the GRPO study at W5A8 mismatch: seven variants x two seeds, tables and figures in recipes/tiny_cpu/study/
study: venv
	bash recipes/tiny_cpu/study/run.sh

clean-outputs:
	rm -rf outputs
