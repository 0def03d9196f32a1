"""Pool-operation metrics come from the durable rows, with nodepool_* names and pool labels."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest

from operations.metrics import OperationsCollector, samples
from operations.models import Preemption, ProviderMachine, ScaleDecision, Upgrade, UpgradeNode
from tests.metrics_support import scrape, value
from tests.operations_support import ready_pool

pytestmark = pytest.mark.django_db


def test_success_rate_scale_up_time_failed_attempts_and_preemptions_are_exported():
    pool, nodes = ready_pool("general", 3)
    upgrade = Upgrade.objects.create(pool=pool, target={"version": "2.0.0"})
    for n, (node, _) in enumerate(nodes):
        UpgradeNode.objects.create(upgrade=upgrade, node=node, phase="roll", position=n,
                                   state="failed" if n == 0 else "done")  # fmt: skip
    now = timezone.now()
    ProviderMachine.objects.create(pool=pool, provider="simulated", name="m-1", state="ready",
                                   requested_at=now - timedelta(seconds=20), pending_since=now - timedelta(seconds=30),
                                   ready_at=now)  # fmt: skip
    ScaleDecision.objects.create(pool=pool, direction="up", outcome="failed", count=1, reason="provider down")
    Preemption.objects.create(node=nodes[0][0], pool=pool, source="agent", deadline=now, received_at=now)

    data = samples()
    assert data["nodepool_upgrade_nodes_total"] == {("general", "done"): 2, ("general", "failed"): 1}
    assert data["nodepool_upgrade_success_ratio"][("general",)] == pytest.approx(2 / 3)
    assert data["nodepool_scale_up_seconds_sum"][("general",)] == pytest.approx(30, abs=0.01)
    assert data["nodepool_scale_attempts_failed_total"] == {("general",): 1}
    assert data["nodepool_preemptions_total"] == {("general",): 1}

    registry = CollectorRegistry()
    registry.register(OperationsCollector())
    text = generate_latest(registry).decode()
    assert 'nodepool_upgrade_nodes_total{outcome="done",pool="general"} 2.0' in text
    assert 'nodepool_preemptions_total{pool="general"} 1.0' in text
    assert 'nodepool_scale_attempts_failed_total{pool="general"} 1.0' in text


def test_the_operations_figures_are_on_the_metrics_endpoint(client):
    """Found while closing the issue: the collector existed but /metrics never registered it."""
    pool, nodes = ready_pool("general", 1)
    now = timezone.now()
    Preemption.objects.create(node=nodes[0][0], pool=pool, source="agent", deadline=now, received_at=now)
    Upgrade.objects.create(pool=pool, target={"version": "2.0.0"})

    text = scrape(client)
    assert value(text, "nodepool_preemptions_total", pool="general") == 1
    assert value(text, "nodepool_upgrades", pool="general", state="pending") == 1
