"""Periodic jobs declared in <app>/schedule.py reach beat's database schedule."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
from django_celery_beat.models import PeriodicTask

from nodepool.beat import DatabaseScheduler
from nodepool.celery import SCHEDULE_MODULES, app, collect_beat_schedule


def _schedule_module(monkeypatch, name: str, entries: dict) -> str:
    module = types.ModuleType(name)
    module.BEAT_SCHEDULE = entries
    monkeypatch.setitem(sys.modules, name, module)
    return name


def test_missing_schedule_modules_are_skipped():
    assert collect_beat_schedule(("nodepool.no_such_schedule",)) == {}


def test_schedules_of_several_apps_are_merged_and_expiry_is_kept_for_the_database(monkeypatch):
    a = _schedule_module(monkeypatch, "fake_a.schedule", {"a.sweep": {"task": "a.sweep", "schedule": 5.0}})
    b = _schedule_module(
        monkeypatch, "fake_b.schedule", {"b.expire": {"task": "b.expire", "schedule": 10, "options": {"expires": 9}}}
    )

    merged = collect_beat_schedule((a, "fake_missing.schedule", b))

    assert set(merged) == {"a.sweep", "b.expire"}
    assert merged["b.expire"]["options"] == {"expires": 9, "expire_seconds": 9}


def test_the_same_entry_declared_twice_is_an_error(monkeypatch):
    a = _schedule_module(monkeypatch, "fake_a.schedule", {"sweep": {"task": "a", "schedule": 5}})
    b = _schedule_module(monkeypatch, "fake_b.schedule", {"sweep": {"task": "b", "schedule": 5}})
    with pytest.raises(ValueError, match="declared twice"):
        collect_beat_schedule((a, b))


def test_a_broken_import_inside_a_schedule_module_is_not_hidden(monkeypatch, tmp_path):
    (tmp_path / "broken_app").mkdir()
    (tmp_path / "broken_app" / "__init__.py").write_text("")
    (tmp_path / "broken_app" / "schedule.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(ModuleNotFoundError):
        collect_beat_schedule(("broken_app.schedule",))


def test_the_finalized_app_carries_every_app_schedule():
    app.finalize()
    expected = collect_beat_schedule(SCHEDULE_MODULES)
    for name in expected:
        assert name in app.conf.beat_schedule


@pytest.fixture
def beat_schedule():
    """Replace the app's beat schedule for one test."""
    entries = {
        "test.sweep": {"task": "nodepool.ping", "schedule": 5.0, "options": {"expires": 4, "expire_seconds": 4}},
    }
    saved = app.conf.beat_schedule
    app.conf.beat_schedule = entries
    yield entries
    app.conf.beat_schedule = saved


@pytest.mark.django_db(transaction=True)
def test_beat_stores_code_schedules_in_the_database(beat_schedule):
    DatabaseScheduler(app=app)

    row = PeriodicTask.objects.get(name="test.sweep")
    assert row.task == "nodepool.ping"
    assert row.interval.every == 5
    assert row.expire_seconds == 4
    assert row.enabled


@pytest.mark.django_db(transaction=True)
def test_an_operator_edit_in_the_database_survives_a_beat_restart(beat_schedule):
    DatabaseScheduler(app=app)
    row = PeriodicTask.objects.get(name="test.sweep")
    row.enabled = False
    row.expire_seconds = 2
    row.save()

    DatabaseScheduler(app=app)

    row.refresh_from_db()
    assert row.enabled is False
    assert row.expire_seconds == 2


@pytest.mark.django_db(transaction=True)
def test_a_deleted_row_comes_back_from_code_at_the_next_beat_start(beat_schedule):
    DatabaseScheduler(app=app)
    PeriodicTask.objects.filter(name="test.sweep").delete()

    DatabaseScheduler(app=app)

    assert PeriodicTask.objects.filter(name="test.sweep", enabled=True).exists()
