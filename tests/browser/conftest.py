"""Browser tests: real Chromium (Debian's ``chromium`` package) driven by pytest-playwright
against pytest-django's live server.

What this directory gives every browser test:

- the ``browser`` marker, added to each test collected here (CI runs them on SQLite only:
  ``-m "not browser"`` on the PostgreSQL run keeps the CI budget);
- Playwright pointed at the system Chromium (``NODEPOOL_CHROMIUM``, default the ``chromium`` on
  PATH): Playwright's own browser download cannot be reached from here;
- ``live_server`` (pytest-django: a threaded server on a free loopback port, static files
  served, a transactional test database);
- ``operator_user`` / ``owner_user`` (staff users with a known password) and ``login(page, user)``;
- screenshots of failing tests in ``var/test-artifacts/<test>/`` (``--screenshot=only-on-failure``
  in pyproject.toml's addopts).

Playwright's sync API keeps an asyncio loop running in the test's thread, so Django would refuse
every ORM call there (SynchronousOnlyOperation). ``DJANGO_ALLOW_ASYNC_UNSAFE`` is set for the
test session once a browser test runs, and only here: no setting of the project enables it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from django.contrib.auth.models import Group, User
from playwright.sync_api import expect

from nodepool.api.permissions import OPERATORS, OWNERS

PASSWORD = "browser-pw-7Q2x"  # a test user's password
TIMEOUT_MS = 15_000  # generous: CI shares two cores with the rest of the suite
# expect(...) waits this long too (its own default is 5 s: too short for /api/docs/ building the
# schema of every operation on a busy machine).
expect.set_options(timeout=TIMEOUT_MS)


def chromium_path() -> str | None:
    configured = os.environ.get("NODEPOOL_CHROMIUM")
    if configured:
        return configured
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _missing_browser() -> str | None:
    path = chromium_path()
    if not path or not Path(path).exists():
        return "no system Chromium (apt-get install -y chromium, or set NODEPOOL_CHROMIUM)"
    return None


def pytest_itemcollected(item):
    """Mark this directory's tests ``browser`` as they are collected, before ``-m "not browser"``
    deselects (the PostgreSQL step of .ci/run runs without them)."""
    item.add_marker(pytest.mark.browser)
    # In CI a missing browser is an install-step failure, not something to skip quietly.
    missing = _missing_browser()
    if missing and not os.environ.get("CI"):
        item.add_marker(pytest.mark.skip(reason=missing))


# Last of all the hooks: pytest's own reordering (by parametrized session fixtures, such as
# pytest-playwright's browser_name) and pytest-django's (by kind of database use) would otherwise
# put the browser tests back in the middle of the session.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # Browser tests last (each xdist worker runs its share in collection order): Playwright's sync
    # API leaves an asyncio loop running in the worker's thread for the rest of the session, where
    # asyncio.run() then fails (the simulator's command line) and DJANGO_ALLOW_ASYNC_UNSAFE is set.
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("browser") is not None)


@pytest.fixture(scope="session", autouse=True)
def _allow_sync_orm_beside_playwright():
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    yield
    if previous is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    """pytest-playwright's launch arguments, with the system Chromium as the executable."""
    return {**browser_type_launch_args, "executable_path": chromium_path()}


@pytest.fixture
def page(page, live_server):
    """pytest-playwright's page, with a timeout fit for a shared machine and the live server's base."""
    page.set_default_timeout(TIMEOUT_MS)
    page.live_server_url = live_server.url
    return page


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # The live server runs in this process, so the override reaches its logins too; PBKDF2's
    # deliberate slowness would cost each browser login about a second on a shared machine.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _staff(username: str, group: str) -> User:
    user = User.objects.create_user(username=username, password=PASSWORD, is_staff=True)
    user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


@pytest.fixture
def operator_user(live_server) -> User:
    return _staff("olivia-operator", OPERATORS)


@pytest.fixture
def owner_user(live_server) -> User:
    return _staff("oscar-owner", OWNERS)


def login(page, user: User, *, password: str = PASSWORD) -> None:
    """Log ``user`` in through the admin's login form, as a person would."""
    page.goto(f"{page.live_server_url}/admin/login/")
    page.get_by_label("Username").fill(user.username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{page.live_server_url}/admin/")


@pytest.fixture
def operator_page(page, operator_user):
    """A page logged in to the admin as an operator."""
    login(page, operator_user)
    return page


@pytest.fixture
def owner_page(page, owner_user):
    """A page logged in to the admin as a marketplace owner."""
    login(page, owner_user)
    return page
