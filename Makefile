# The two set-up commands of the README: `make demo` and `make test`.
# Both create .venv and install moelab with the CPU build of torch first, so that pip
# never resolves torch itself (an unpinned torch pulls several GB of CUDA packages).
#
# Every package version comes from the lock, requirements/lock.txt: a pip constraints file
# of the exact versions the test suite passed on (direct and transitive, pip and the build
# backend included). `make test-latest` tries the newest versions pyproject.toml's ranges
# allow in a second environment; `make lock` promotes that environment's versions to the
# lock once the suite passed there. README, "Supported versions".
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
LOCK   ?= requirements/lock.txt
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.moelab-installed
# the newest-allowed environment (make test-latest) and what it runs (default: the whole suite)
VENV_LATEST  ?= .venv-latest
LATEST_TESTS ?= tests
# Debian's chromium lets the test suite check the demo report in a real browser
# (tests/test_demo_browser.py; skipped where no Chromium is on PATH). `auto`: install it
# with apt-get when running as root on a machine with apt and no Chromium yet (about
# 15 s, 25 packages); `no`: never touch the system.
CHROMIUM ?= auto

.PHONY: install demo test test-latest lock lint clean chromium

# The build backend (setuptools, wheel) comes from the lock too: it is installed into the venv
# and the editable build runs without build isolation, which would fetch the newest setuptools.
$(STAMP): pyproject.toml setup.py $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(LOCK) pip
	$(PY) -m pip install -c $(LOCK) "$(TORCH)"
	$(PY) -m pip install -c $(LOCK) setuptools wheel
	$(PY) -m pip install -c $(LOCK) --no-build-isolation -e ".[dev]"
	$(PY) -m pip check
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
	MOELAB_EXPECT_LOCK=$(LOCK) $(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

# A fresh environment with the newest versions pyproject.toml's ranges allow (torch stays
# $(TORCH): newer torch releases on the index are CUDA builds), then the suite. Its resolved
# versions and their difference from the lock are written to $(VENV_LATEST)/resolved.txt.
test-latest: chromium
	rm -rf $(VENV_LATEST)
	$(PYTHON) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade pip setuptools wheel
	$(VENV_LATEST)/bin/python -m pip install "$(TORCH)"
	$(VENV_LATEST)/bin/python -m pip install --upgrade --upgrade-strategy eager --no-build-isolation -e ".[dev]"
	$(VENV_LATEST)/bin/python -m pip check
	$(VENV_LATEST)/bin/python scripts/lock.py diff $(VENV_LATEST) $(LOCK) | tee $(VENV_LATEST)/resolved.txt
	$(VENV_LATEST)/bin/python -m pytest -q -n 2 --dist loadgroup --durations=15 $(LATEST_TESTS)

# Promote the versions of $(VENV_LATEST) (after `make test-latest` passed) to the lock.
lock:
	$(PYTHON) scripts/lock.py write $(VENV_LATEST) $(LOCK)

lint: $(STAMP)
	$(VENV)/bin/ruff check moelab tests scripts

clean:
	rm -rf $(VENV) $(VENV_LATEST) build *.egg-info report.html out
