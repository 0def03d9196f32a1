# nodepool — make targets. Everything runs from the project's own virtual environment.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt requirements-dev.txt pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
# Two pytest-xdist workers (this kind of machine has 2 cores): each gets its own test database
# (test_<name>_gw0 on PostgreSQL, var/test-nodepool.sqlite3_gw0 on SQLite). XDIST= runs serially.
XDIST ?= -n 2
ARGS ?=

.PHONY: venv test lint format migrate run demo superuser clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	@# The project itself, editable: its console scripts (nodepoolctl, nodepool-agent) in $(VENV)/bin.
	$(PY) -m pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

test: venv  ## run the test suite (SQLite + embedded broker, or DATABASE_URL / CELERY_BROKER_URL)
	@# Exit status 5 means "no tests collected" (e.g. a -k that matches nothing): not a failure.
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS) || test $$? -eq 5

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

migrate: venv
	$(PY) manage.py migrate --noinput

run: migrate  ## web + one Celery worker + beat on the configured (default: embedded) backends
	$(PY) manage.py collectstatic --noinput -v0
	LOG_FORMAT=$${LOG_FORMAT:-text} $(PY) -m nodepool.procfile -f Procfile start

demo: venv  ## the main job: the whole control plane with this machine and a simulated fleet
	@# No `migrate` first: the demo migrates (and collects static files into) its own var dir,
	@# never the default database.
	LOG_FORMAT=$${LOG_FORMAT:-text} $(PY) manage.py demo $(ARGS)

clean:
	rm -rf var/*.sqlite3* var/static
