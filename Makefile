# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv and install moelab with the CPU build of torch first, so that pip
# never resolves torch itself (an unpinned torch pulls several GB of CUDA packages).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.moelab-installed
# Debian's chromium lets the test suite check the demo report in a real browser
# (tests/test_demo_browser.py; skipped where no Chromium is on PATH). `auto`: install it
# with apt-get when running as root on a machine with apt and no Chromium yet (about
# 15 s, 25 packages); `no`: never touch the system.
CHROMIUM ?= auto

.PHONY: install demo test lint clean chromium

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade "pip>=24"
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[dev]"
	touch $(STAMP)

install: $(STAMP) chromium

chromium:
	@if [ "$(CHROMIUM)" = no ] || command -v chromium >/dev/null 2>&1 \
	    || command -v chromium-browser >/dev/null 2>&1 || command -v google-chrome >/dev/null 2>&1; then \
	  exit 0; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's chromium for the report's browser test (make CHROMIUM=no skips this)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium >/dev/null) || echo "warning: could not install chromium; the browser test will be skipped"; \
	else \
	  echo "note: no Chromium on PATH; the report's browser test will be skipped (sudo apt-get install chromium)"; \
	fi

demo: $(STAMP)
	$(VENV)/bin/moelab demo --out report.html --overwrite --allow-code-execution

test: $(STAMP) chromium
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check moelab tests

clean:
	rm -rf $(VENV) build *.egg-info report.html out
