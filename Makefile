# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# The venv is made on first use and re-made when pyproject.toml or constraints.txt change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# One torch thread per process: two xdist workers with two threads each run ~4x slower here.
export OMP_NUM_THREADS := 1
export MKL_NUM_THREADS := 1

.PHONY: run test fuzz nightly bench mutation clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)
	@echo "wsb is $(VENV)/bin/wsb (or: source $(VENV)/bin/activate; wsb --help)"

run: $(STAMP)
	$(PY) -m weight_sync_bench check

test: $(STAMP)
	$(PY) -m pytest -n auto; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no test: that is a failure here" >&2; fi; exit $$rc

# A user's fuzz run (MINUTES=5 by default); the nightly job's long run, same commands.
fuzz: $(STAMP)
	$(PY) -m weight_sync_bench fuzz --minutes $(or $(MINUTES),5)

nightly: $(STAMP)
	WSB_PROFILE=wsb-nightly $(PY) -m pytest -n auto -m "slow or not slow"
	$(PY) -m weight_sync_bench fuzz --profile wsb-nightly --minutes $(or $(MINUTES),60)

bench: $(STAMP)
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# Mutation testing of the harness's core (mutation/report.md): about 75 minutes from scratch on
# 2 cores, two workers, for the 4197 mutants of the eleven modules (the afternoon's eight took
# 40 minutes on one worker; the training step and the checker 46, the placements 6, on two); `rm -rf mutants` first
# for a run from scratch (mutmut keeps results only while the tests it has stats for are
# unchanged).
mutation: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check mutmut==3.8.1
	$(VENV)/bin/mutmut run --max-children 2
	$(PY) mutation/summarize.py --json mutants/summary.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
