"""Configuration from the environment: the development secret and DEBUG."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.processes import ROOT

# Run the settings module alone (not django.setup()): fast, and exactly what each process reads.
SHOW = (
    "import json, runpy; s = runpy.run_path('nodepool/settings.py'); print(json.dumps([s['SECRET_KEY'], s['DEBUG']]))"
)


def settings_in_child(tmp_path, **env) -> tuple[str, bool]:
    child = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG")}
    child.update(NODEPOOL_VAR_DIR=str(tmp_path / "var"), DJANGO_SETTINGS_MODULE="nodepool.settings", **env)
    out = subprocess.run([sys.executable, "-c", SHOW], cwd=ROOT, env=child, capture_output=True, text=True, check=True)
    key, debug = json.loads(out.stdout.strip().splitlines()[-1])
    return key, debug


def test_without_secret_key_one_is_generated_once_into_var_with_0600(tmp_path):
    first, _ = settings_in_child(tmp_path)
    second, _ = settings_in_child(tmp_path)

    key_file = tmp_path / "var" / "secret_key"
    assert first == second == key_file.read_text().strip()
    assert len(first) >= 50
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in (tmp_path / "var").iterdir() if p.name.startswith(".secret_key")] == []


def test_processes_starting_together_agree_on_the_generated_secret(tmp_path):
    child = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG")}
    child.update(NODEPOOL_VAR_DIR=str(tmp_path / "var"), DJANGO_SETTINGS_MODULE="nodepool.settings")
    procs = [
        subprocess.Popen([sys.executable, "-c", SHOW], cwd=ROOT, env=child, stdout=subprocess.PIPE, text=True)
        for _ in range(8)
    ]
    keys = {json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1])[0] for p in procs}
    assert len(keys) == 1


def test_a_secret_key_from_the_environment_is_used_and_nothing_is_written(tmp_path):
    key, _ = settings_in_child(tmp_path, SECRET_KEY="from-the-environment")
    assert key == "from-the-environment"
    assert not (tmp_path / "var" / "secret_key").exists()


def test_debug_is_off_unless_asked_for(tmp_path):
    assert settings_in_child(tmp_path)[1] is False


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("0", False), ("false", False)])
def test_debug_follows_the_environment(tmp_path, value, expected):
    assert settings_in_child(tmp_path, DEBUG=value)[1] is expected


def test_the_secret_key_file_is_never_committed():
    ignored = subprocess.run(["git", "check-ignore", "-q", "var/secret_key"], cwd=ROOT)
    assert ignored.returncode == 0
