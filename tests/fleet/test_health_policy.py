"""Health: conditions judged under the pool's policy (pure functions)."""

from __future__ import annotations

import pytest

from fleet.choices import Health
from fleet.health import evaluate, evaluate_for_pool, is_positive
from fleet.models import Pool


def c(kind, status, reason=""):
    return {"type": kind, "status": status, "reason": reason}


def test_no_bad_condition_is_healthy():
    assert evaluate_for_pool([c("Ready", "True"), c("MemoryPressure", "False")], Pool()) == (Health.HEALTHY, [])


@pytest.mark.parametrize("kind", ["MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable"])
def test_kubernetes_pressure_conditions_are_unhealthy_by_default(kind):
    health, reasons = evaluate_for_pool([c(kind, "True", "Low")], Pool())
    assert health == Health.UNHEALTHY and reasons == [f"{kind}=True (Low)"]


def test_ready_false_is_unhealthy_whatever_the_policy_lists():
    assert evaluate([c("Ready", "False")], unhealthy=[], degraded=[])[0] == Health.UNHEALTHY


def test_clock_skew_only_degrades_by_default():
    assert evaluate_for_pool([c("ClockSkew", "True")], Pool())[0] == Health.DEGRADED


def test_a_pool_policy_replaces_the_defaults():
    pool = Pool(unhealthy_conditions=["GPUReady", "XidErrors"], degraded_conditions=["MemoryPressure"])
    assert evaluate_for_pool([c("MemoryPressure", "True")], pool)[0] == Health.DEGRADED
    assert evaluate_for_pool([c("GPUReady", "False")], pool)[0] == Health.UNHEALTHY
    assert evaluate_for_pool([c("XidErrors", "True")], pool)[0] == Health.UNHEALTHY
    assert evaluate_for_pool([c("DiskPressure", "True")], pool)[0] == Health.HEALTHY  # not in this policy


def test_unknown_status_of_a_policy_condition_degrades():
    assert evaluate_for_pool([c("MemoryPressure", "Unknown")], Pool())[0] == Health.DEGRADED


def test_unhealthy_wins_over_degraded_and_lists_both():
    health, reasons = evaluate_for_pool([c("ClockSkew", "True"), c("DiskPressure", "True")], Pool())
    assert health == Health.UNHEALTHY and reasons == ["DiskPressure=True", "ClockSkew=True"]


def test_polarity_follows_kubernetes_names():
    assert is_positive("Ready") and is_positive("GPUReady") and is_positive("RuntimeAvailable")
    assert not is_positive("MemoryPressure") and not is_positive("NetworkUnavailable")
