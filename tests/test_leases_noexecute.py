"""NoExecute taints added while leases run evict the leases that do not tolerate them (Kubernetes'
taint manager), after tolerationSeconds where the toleration has one."""

from __future__ import annotations

import pytest
from django.utils import timezone

from fleet.events import Actor
from fleet.models import Node, NodeResource
from leases.choices import LeaseState
from leases.models import Lease
from leases.services import lease_create
from leases.sweeps import evict_noexecute
from tests.factories import PoolFactory, make_schedulable_node

pytestmark = pytest.mark.django_db
TAINT = {"key": "maintenance", "value": "now", "effect": "NoExecute"}


def grant(user, workload_id, tolerations=None):
    body = {"workload_id": workload_id, "pool": "taints", "resources": {"cpu": "1"}}
    if tolerations is not None:
        body["tolerations"] = tolerations
    lease, status = lease_create(data=body, client=user, actor=Actor.system("test"))
    assert status == 201
    return lease


@pytest.fixture
def node():
    node, _ = make_schedulable_node(PoolFactory(name="taints"), resources={"cpu": 8000, "memory": 2**34})
    return node


def taint(node, *taints):
    Node.objects.filter(pk=node.pk).update(taints=list(taints))


def test_an_untolerated_noexecute_taint_revokes_the_lease_and_frees_capacity(client_user, node):
    lease = grant(client_user, "plain")
    taint(node, TAINT)
    assert evict_noexecute() == 1
    lease.refresh_from_db()
    assert lease.state == LeaseState.REVOKED and "NoExecute" in lease.end_reason
    assert NodeResource.objects.get(node=node, name="cpu").allocated == 0
    assert evict_noexecute() == 0  # a second run changes nothing


def test_a_tolerated_noexecute_taint_keeps_the_lease(client_user, node):
    lease = grant(client_user, "tolerant", [{"key": "maintenance", "operator": "Exists", "effect": "NoExecute"}])
    taint(node, TAINT)
    assert evict_noexecute() == 0
    lease.refresh_from_db()
    assert lease.state == LeaseState.GRANTED


def test_toleration_seconds_delays_the_eviction_from_when_the_taint_was_added(client_user, node, time_machine):
    toleration = [
        {"key": "maintenance", "operator": "Equal", "value": "now", "effect": "NoExecute", "toleration_seconds": 60}
    ]
    time_machine.move_to(timezone.now(), tick=False)
    lease = grant(client_user, "patient", toleration)
    time_machine.shift(300)
    taint(node, {**TAINT, "time_added": timezone.now().isoformat()})
    time_machine.shift(59)
    assert evict_noexecute() == 0
    time_machine.shift(2)
    assert evict_noexecute() == 1
    assert Lease.objects.get(pk=lease.pk).state == LeaseState.REVOKED


def test_noschedule_taints_never_evict_running_leases(client_user, node):
    lease = grant(client_user, "stays")
    taint(node, {**TAINT, "effect": "NoSchedule"})
    assert evict_noexecute() == 0
    assert Lease.objects.get(pk=lease.pk).state == LeaseState.GRANTED


def test_a_negative_toleration_seconds_is_refused(client_user, node):
    from nodepool.api.problems import Problem

    with pytest.raises(Problem) as refused:
        grant(client_user, "bad", [{"key": "k", "operator": "Exists", "toleration_seconds": -1}])
    assert refused.value.status_code == 400
    assert not Lease.objects.exists()
