# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv and install moelab with the CPU build of torch first, so that pip
# never resolves torch itself (an unpinned torch pulls several GB of CUDA packages).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.moelab-installed

.PHONY: install demo test lint clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=24"
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/moelab demo --out report.html --overwrite --allow-code-execution

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check moelab tests

clean:
	rm -rf $(VENV) build *.egg-info report.html
