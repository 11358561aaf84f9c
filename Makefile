# The two commands of the README's quick start: `make run` and `make test`.
# One install serves both: the service, its tests and the bench they exercise
# (extras test and bench). `make lint` adds the dev extra (ruff and mypy, pinned)
# on top, so that mypy sees every import of src/ and tests/.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: run test test-pg lint soak race clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found; set PYTHON=python3"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[dev,test,bench]'
	touch $(DEV_STAMP)

run: $(STAMP)
	$(BIN)/pgreserve up

test: $(STAMP)
	$(BIN)/pytest

# The tests that use the session's server, on an installed PostgreSQL instead of the
# embedded 18 (Debian: apt-get install postgresql-15). `.ci/run` runs it.
PG_BIN ?= /usr/lib/postgresql/15/bin
test-pg: $(STAMP)
	PGRESERVE_TEST_PG_BIN=$(PG_BIN) $(BIN)/pytest

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy src tests

# The fault-injection suite for SECONDS seconds of load (default 600); the
# report (docs/soak.md) ends with "soak: N operations, N faults injected, ...".
# The load, its resolution and the audit finish within SECONDS plus a few minutes.
SECONDS ?= 600
SOAK_REPORT := .pgreserve/soak-report.txt
soak: $(STAMP)
	@mkdir -p .pgreserve && rm -f $(SOAK_REPORT)
	@status=0; PGRESERVE_SOAK_SECONDS=$(SECONDS) PGRESERVE_SOAK_REPORT=$(SOAK_REPORT) \
	  $(BIN)/pytest -q -p no:cacheprovider -p no:logging \
	  tests/faults/test_faults.py::test_no_oversell_no_lost_hold_under_faults \
	  >.pgreserve/soak-pytest.log 2>&1 || status=$$?; \
	  tail -n 3 .pgreserve/soak-pytest.log; \
	  cat $(SOAK_REPORT) 2>/dev/null || echo "soak: no report (see .pgreserve/soak-pytest.log)"; \
	  exit $$status

# The race checker (tests/race) for SECONDS seconds of load per strategy;
# PGRESERVE_RACE_SEED=N replays the random choices of a printed seed.
race: $(STAMP)
	PGRESERVE_RACE_SECONDS=$(SECONDS) $(BIN)/pytest -q -s -p no:cacheprovider -m race tests/race

clean:
	rm -rf $(VENV) .pgreserve .pytest_cache
