# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := demo

.PHONY: install demo test lint bench fuzz clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	rm -rf $(DEMO)
	$(BIN)/python -m mosaic.demo $(DEMO)

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check mosaic tests bench

bench: $(STAMP)
	$(BIN)/python bench/run.py

fuzz: $(STAMP)
	MOSAIC_FUZZ_EXAMPLES=20000 $(BIN)/python -m pytest tests/test_fuzz.py

clean:
	rm -rf $(VENV) $(DEMO) out .pytest_cache .hypothesis
