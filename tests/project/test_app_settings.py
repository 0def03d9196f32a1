"""Per-app settings (issue 28, step 1): declared once, typed, read one way, documented in one table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command

from nodepool import appsettings
from nodepool.appsettings import AppSettings, Setting

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("fleet", "leases", "maintenance", "operations", "marketplace", "nodepool")


def test_the_table_in_docs_foundation_is_current():
    call_command("app_settings", "--check")


def test_every_app_declares_its_settings_and_no_name_twice():
    declared = [(app.app, name) for app in appsettings.every_app() for name in app.declared]
    assert {app for app, _ in declared} == set(PRODUCT)
    names = [name for _, name in declared]
    assert len(names) == len(set(names)), "a setting declared by two apps"


def test_no_call_site_reads_the_nodepool_dict_or_repeats_a_default():
    """Only nodepool.appsettings reads ``settings.NODEPOOL``; the apps ask their ``conf``."""
    pattern = re.compile(r"(?<!`)settings\.NODEPOOL\b|getattr\(settings, \"NODEPOOL\"")  # not ``in docs``
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for package in PRODUCT
        for path in (ROOT / package).rglob("*.py")
        if path.name != "appsettings.py" and "migrations" not in path.parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_a_value_comes_from_the_override_then_the_environment_then_the_default(settings, monkeypatch):
    conf = AppSettings(
        "example",
        Setting("EXAMPLE_RATE", float, 0.5, "a fraction"),
        Setting("EXAMPLE_TYPES", list, ["a"], "names"),
    )
    settings.NODEPOOL = {}
    assert conf.get("EXAMPLE_RATE") == 0.5 and conf.get("EXAMPLE_TYPES") == ["a"]

    fresh = AppSettings("example", *conf.declared.values())
    monkeypatch.setenv("NODEPOOL_EXAMPLE_RATE", "0.25")
    monkeypatch.setenv("NODEPOOL_EXAMPLE_TYPES", "x,y")
    assert fresh.get("EXAMPLE_RATE") == 0.25  # parsed as the declared type
    assert fresh.get("EXAMPLE_TYPES") == ["x", "y"]

    settings.NODEPOOL = {"EXAMPLE_RATE": 0}
    assert fresh.get("EXAMPLE_RATE") == 0  # an override wins, as given

    with pytest.raises(KeyError):
        fresh.get("UNDECLARED")
    monkeypatch.setenv("NODEPOOL_EXAMPLE_BAD", "not a number")
    bad = AppSettings("example", Setting("EXAMPLE_BAD", int, 1, "a count"))
    with pytest.raises((ImproperlyConfigured, ValueError)):
        bad.get("EXAMPLE_BAD")


def test_the_operator_environment_names_stay(monkeypatch):
    """The variables that settings.py read before per-app settings are still read, with their types."""
    from fleet import conf as fleet_conf
    from marketplace import conf as marketplace_conf

    for conf, name, raw, value in [
        (fleet_conf, "MIN_SPACING_FRACTION", "0.01", 0.01),
        (fleet_conf, "MAX_HEARTBEATS_PER_SECOND", "50", 50.0),
        (fleet_conf, "CREDENTIAL_ROTATIONS_PER_HOUR", "100000", 100000),
        (marketplace_conf, "SETTLEMENT_WINDOW_MIN", "60", 60),
    ]:
        monkeypatch.setenv(f"NODEPOOL_{name}", raw)
        fresh = AppSettings("copy", *conf.SETTINGS.declared.values())
        assert fresh.get(name) == value
