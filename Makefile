# Two commands set everything up on a fresh machine (Python, gcc, cmake):
#   make demo   — venv, package, llama.cpp engine, demo model, then the main job (auto-tune) on it
#   make test   — the same set-up, then the fast tier (pure code, fails fast), then the suite against the real engine
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.moe-tune-installed

.PHONY: setup engine demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP) engine

engine: $(STAMP)
	$(BIN)/moe-tune engine install

demo: setup
	$(BIN)/moe-tune demo-model --quant Q8_0,Q4_K_M
	$(BIN)/moe-tune doctor
	$(BIN)/moe-tune auto-tune --workload chat --trials 10

test: setup
	$(BIN)/python -m pytest -m fast -x -q
	$(BIN)/python -m pytest -m "not fast"

lint: $(STAMP)
	$(BIN)/ruff check tuner tests scripts
	$(BIN)/mypy tuner

clean:
	rm -rf $(VENV) build *.egg-info
