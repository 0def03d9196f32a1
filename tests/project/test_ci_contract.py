"""The README's test command and CI: ``make test`` fails on any failure, never on "no tests collected"."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.processes import ROOT

pytestmark = pytest.mark.slow


def make_test(tmp_path, body: str) -> int:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_sample.py").write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    args = f"-p no:django -p no:cacheprovider -c {tmp_path / 'pytest.ini'} --rootdir {tmp_path} {tmp_path}"
    result = subprocess.run(
        ["make", "-s", "-o", "venv", "test", "XDIST=", f"PYTEST_ARGS={args}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    return result.returncode


@pytest.mark.parametrize(
    ("body", "passes"),
    [
        ("def test_ok():\n    assert True\n", True),
        ("def test_broken():\n    assert False\n", False),
        ("import no_such_module_xyz\n", False),
        ("# no tests here\n", True),
    ],
    ids=["passing", "failing", "collection-error", "no-tests-collected"],
)
def test_make_test_exit_status(tmp_path, body, passes):
    assert (make_test(tmp_path, body) == 0) is passes


def test_ci_script_is_strict_bash_and_runs_both_stacks():
    script = (ROOT / ".ci" / "run").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")]).returncode == 0
    assert "set -euo pipefail" in script
    for needed in ("ruff check", "ruff format --check", "pg_isready", "redis-cli", "make test"):
        assert needed in script
    assert script.index('DATABASE_URL="$PG_URL"') < script.index("env -u DATABASE_URL -u CELERY_BROKER_URL -u")


def test_ci_installs_the_system_chromium_idempotently_and_runs_browser_tests_on_sqlite_only():
    script = (ROOT / ".ci" / "run").read_text()
    step = script[script.index('step "system Chromium') :]
    assert (
        step.index("command -v chromium") < step.index("apt-get update") < step.index("apt-get install -y -q chromium")
    )
    pg_step = script[script.index('step "tests on PostgreSQL') : script.index('step "tests on SQLite')]
    assert '-m "not browser"' in pg_step
    assert "not browser" not in script[script.index('step "tests on SQLite') :]


def collected(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    result = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_the_postgresql_steps_filter_leaves_out_every_browser_test_and_the_sqlite_step_runs_them_last():
    """``-m "not browser"`` must see the marker (it is added as each test is collected), and the
    browser tests must run after every other test of their worker: Playwright's sync API leaves a
    running asyncio loop behind it (the simulator's command line once failed in CI that way)."""
    files = (
        "tests/browser/test_admin_login.py",
        "tests/plumbing/test_smoke.py",
        "tests/operations/test_operations_admin_settings.py",
    )
    without_browser = collected("-m", "not browser", *files)
    assert without_browser and not [item for item in without_browser if item.startswith("tests/browser/")]
    order = collected(*files)
    browser = [i for i, item in enumerate(order) if item.startswith("tests/browser/")]
    assert browser and browser == list(range(len(order) - len(browser), len(order)))
    assert not [item for item in order if "[chromium]" in item and not item.startswith("tests/browser/")]
