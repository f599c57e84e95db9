# Two commands set everything up on a fresh machine (Python, gcc, cmake):
#   make demo   — venv, package, llama.cpp engine, demo model, then the main job (auto-tune) on it
#   make test   — the same set-up, then the fast tier (pure code, fails fast), then ik_llama.cpp built beside llama.cpp,
#                 then the suite against the real engines
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.moe-tune-installed

.PHONY: setup engine engine-ik demo test lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP) engine

engine: $(STAMP)
	$(BIN)/moe-tune engine install

# ik_llama.cpp, the second engine auto-tune judges (about 15 minutes on 2 cores; the tests run it)
engine-ik: $(STAMP)
	$(BIN)/moe-tune engine install --engine ik

demo: setup
	$(BIN)/moe-tune demo-model --quant Q8_0,Q4_K_M
	$(BIN)/moe-tune doctor
	$(BIN)/moe-tune auto-tune --workload chat --trials 10

test: setup
	$(BIN)/python -m pytest -m fast -x -q
	$(BIN)/moe-tune engine install --engine ik
	$(BIN)/python -m pytest -m "not fast"

lint: $(STAMP)
	$(BIN)/ruff check tuner tests scripts
	$(BIN)/mypy tuner

clean:
	rm -rf $(VENV) build *.egg-info
