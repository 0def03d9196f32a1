"""Shared fixtures: the cast of users (operator, owner, client) and API clients for each."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from rest_framework.test import APIClient

from nodepool.api import errors
from nodepool.api.permissions import CLIENTS, OPERATORS, OWNERS
from nodepool.tokens import create_user_token
from tests.celery_support import broker  # noqa: F401  (the real-worker fixture, for any test file)

# A problem answered with an undeclared code (or another status than declared) fails the test that
# reaches it (nodepool.api.errors); in production it is logged.
errors.STRICT = True


@pytest.fixture(autouse=True)
def _eager_celery(settings):
    """Unit tests run tasks inline; tests/plumbing/test_celery_worker.py starts real workers instead.

    An eager task runs inside celery's ``denied_join_result()``, which saves and restores a
    process-global flag (``celery._state._task_join_will_block``), not a per-thread one. Eager
    tasks that overlap in threads (the concurrency and race tests) restore it out of order and can
    leave it True; from then on every ``result.get()`` in that process raises "Never call
    result.get() within a task!" (the real-worker tests later in the same xdist worker). So each
    test starts and ends with it False."""
    from celery import _state

    from nodepool.celery import app

    _state._set_task_join_will_block(False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    yield
    app.conf.task_always_eager = False
    _state._set_task_join_will_block(False)


@pytest.fixture(autouse=True)
def _fresh_local_cache():
    """Every test starts with an empty per-process cache. The local-memory cache stores absolute
    expiry times: a test that moved the clock into the future (time_machine) left keys that, back
    on the real clock, live until then. One such key (the lease queue's one-a-second kick guard)
    silenced every later kick in the process, so CI's autoscaling e2e waited for placements that
    never came. A shared cache (CACHE_URL) is left alone."""
    from django.core.cache import caches
    from django.core.cache.backends.locmem import LocMemCache

    backend = caches["default"]
    if isinstance(backend, LocMemCache):
        backend.clear()  # the storage is per process, shared by every thread's instance
    yield


@pytest.fixture(autouse=True)
def _fresh_renewal_caches():
    """fleet.renewals keeps pool timings and node pools per process; tests reuse ids."""
    from fleet.renewals import forget_cached_timings

    forget_cached_timings()
    yield
    forget_cached_timings()


@pytest.fixture(autouse=True)
def _fresh_auth_failure_state(settings):
    """nodepool.auth_failures keeps blocked addresses and accepted credentials per process. Its
    limits are off unless a test turns them on (``settings.NODEPOOL``; tests/plumbing/test_failed_auth_limits.py): fuzz
    and security tests send made-up credentials and wrong passwords by the dozen from one address,
    and expect each one's own refusal."""
    from nodepool.auth_failures import reset_process_state

    settings.NODEPOOL = {**settings.NODEPOOL, "AUTH_FAILURE_LIMIT": 0, "LOGIN_ACCOUNT_FAILURE_LIMIT": 0}
    reset_process_state()
    yield
    reset_process_state()


@pytest.fixture
def admin_user(db) -> User:
    """The superuser behind pytest-django's ``admin_client``, named as the admin tests expect it in
    hold owners and events (``user:ada-admin``)."""
    return User.objects.create_superuser("ada-admin", password="pw")


@pytest.fixture
def clock_at_t0(time_machine):
    """The clock stopped at ``tests.heartbeat_support.T0`` (moved on with ``time_machine``), and an
    empty cache, shared or not: the fleet size behind the heartbeat interval and the flood guard's
    spacing are cached."""
    from django.core.cache import cache

    from tests.heartbeat_support import T0

    cache.clear()
    time_machine.move_to(T0, tick=False)
    return time_machine


@pytest.fixture
def no_flood_guard(settings):
    """For tests about ordering, not spacing: they send messages back to back on purpose.
    The flood guard itself is tested in tests/fleet/test_renewals_flood.py."""
    settings.NODEPOOL = {**settings.NODEPOOL, "MIN_SPACING_FRACTION": 0.0}


def _user(username: str, group: str | None) -> User:
    user = User.objects.create_user(username=username, password="pw-" + username)
    if group:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


@pytest.fixture
def operator(db) -> User:
    return _user("olivia-operator", OPERATORS)


@pytest.fixture
def owner(db) -> User:
    return _user("oscar-owner", OWNERS)


@pytest.fixture
def other_owner(db) -> User:
    return _user("otto-other-owner", OWNERS)


@pytest.fixture
def client_user(db) -> User:
    return _user("carla-client", CLIENTS)


def _api(user: User | None) -> APIClient:
    api = APIClient()
    if user is not None:
        _, key = create_user_token(user)
        api.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return api


@pytest.fixture
def anon_api() -> APIClient:
    return APIClient()


@pytest.fixture
def operator_api(operator) -> APIClient:
    return _api(operator)


@pytest.fixture
def owner_api(owner) -> APIClient:
    return _api(owner)


@pytest.fixture
def client_api(client_user) -> APIClient:
    return _api(client_user)


# --- race tests must have run on PostgreSQL where CI asks for it -----------------------------------
# select_for_update takes row locks only on PostgreSQL; on SQLite, BEGIN IMMEDIATE serialises every
# writing transaction, so a race test there cannot see a missing lock. CI sets
# NODEPOOL_REQUIRE_PG_RACES=1 for its PostgreSQL run; the session then fails loudly unless it ran
# on PostgreSQL and at least one test marked `race` passed.
_race_tests = {"passed": 0, "failed": 0, "skipped": 0}


def pytest_runtest_logreport(report):
    if "race" not in report.keywords:
        return
    if report.when == "call":
        _race_tests["passed" if report.passed else "failed" if report.failed else "skipped"] += 1
    elif report.when == "setup" and report.skipped:
        _race_tests["skipped"] += 1


def pytest_sessionfinish(session, exitstatus):
    import os

    if os.environ.get("NODEPOOL_REQUIRE_PG_RACES") != "1" or hasattr(session.config, "workerinput"):
        return  # not asked for, or an xdist worker (the controller sees every worker's reports)
    from django.conf import settings

    engine = settings.DATABASES["default"]["ENGINE"]
    problems = []
    if "postgresql" not in engine:
        problems.append(f"the database is {engine}, not PostgreSQL")
    if _race_tests["passed"] == 0:
        problems.append(f"no test marked `race` passed ({_race_tests})")
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "NODEPOOL_REQUIRE_PG_RACES=1 but the race tests did not run on PostgreSQL: " + "; ".join(problems)
        if reporter:
            reporter.write_line(message, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
