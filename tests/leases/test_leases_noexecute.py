"""NoExecute taints added while leases run evict the leases that do not tolerate them (Kubernetes'
taint manager), after tolerationSeconds where the toleration has one."""

from __future__ import annotations

import pytest
from django.utils import timezone

from fleet.events import Actor
from fleet.models import Node, NodeResource, Pool
from fleet.services import pool_update
from leases.choices import LeaseState
from leases.models import Lease
from leases.sweeps import evict_noexecute
from tests import support
from tests.factories import PoolFactory, make_schedulable_node
from tests.maintenance_support import run_for

pytestmark = pytest.mark.django_db
TAINT = {"key": "maintenance", "value": "now", "effect": "NoExecute"}


def grant(user, workload_id, tolerations=None):
    extra = {"tolerations": tolerations} if tolerations is not None else {}
    return support.grant(user, workload_id, pool="taints", **extra)


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


def test_toleration_seconds_delays_the_eviction_from_when_the_pool_policy_added_the_taint(
    client_user, node, time_machine
):
    toleration = [
        {"key": "maintenance", "operator": "Equal", "value": "now", "effect": "NoExecute", "toleration_seconds": 60}
    ]
    time_machine.move_to(timezone.now(), tick=False)
    lease = grant(client_user, "patient", toleration)
    time_machine.shift(300)
    pool = Pool.objects.get(pk=node.pool_id)
    pool_update(pool_id=pool.pk, expected_version=pool.version, changes={"taints": [TAINT]}, actor=Actor.system("t"))
    added = Node.objects.get(pk=node.pk).taints_added_at
    assert added == {"maintenance:NoExecute": timezone.now().isoformat()}
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


def test_toleration_seconds_count_from_when_an_operator_adds_the_taint_through_the_api(
    client_user, operator_api, node, time_machine
):
    # The lease tolerates the taint for 600 s; an operator adds it an hour after the grant.
    tolerant = [{"key": "maintenance", "operator": "Exists", "effect": "NoExecute", "toleration_seconds": 600}]
    time_machine.move_to(timezone.now(), tick=False)
    lease = grant(client_user, "patient", tolerant)
    time_machine.shift(3600)
    pool = node.pool
    pool.refresh_from_db()
    response = operator_api.patch(
        f"/api/v1/pools/{pool.name}", {"taints": [TAINT]}, format="json", HTTP_IF_MATCH=f'"{pool.version}"'
    )
    assert response.status_code == 200
    assert Node.objects.get(pk=node.pk).taints == [TAINT]

    time_machine.shift(10)
    assert evict_noexecute() == 0, "600 s of toleration, not 600 s since the grant"
    run_for(time_machine, 589)  # the control plane running meanwhile (a bare jump would be a paused gap)
    assert evict_noexecute() == 0
    assert Lease.objects.get(pk=lease.pk).state == LeaseState.GRANTED
    time_machine.shift(2)
    assert evict_noexecute() == 1
    assert Lease.objects.get(pk=lease.pk).state == LeaseState.REVOKED


def test_a_taint_kept_across_a_pool_change_keeps_its_time_and_a_removed_one_is_forgotten(node, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    first = timezone.now()
    other = {"key": "gpu", "value": "yes", "effect": "NoSchedule"}
    pool = Pool.objects.get(pk=node.pool_id)
    pool = pool_update(
        pool_id=pool.pk, expected_version=pool.version, changes={"taints": [TAINT]}, actor=Actor.system("t")
    )
    time_machine.shift(120)
    changed = {**TAINT, "value": "soon"}  # same key and effect: the same taint, as in Kubernetes
    pool_update(
        pool_id=pool.pk, expected_version=pool.version, changes={"taints": [changed, other]}, actor=Actor.system("t")
    )

    node.refresh_from_db()
    assert node.taints == [changed, other]
    assert node.taints_added_at == {
        "maintenance:NoExecute": first.isoformat(),
        "gpu:NoSchedule": timezone.now().isoformat(),
    }
    pool.refresh_from_db()
    pool_update(pool_id=pool.pk, expected_version=pool.version, changes={"taints": [other]}, actor=Actor.system("t"))
    node.refresh_from_db()
    assert set(node.taints_added_at) == {"gpu:NoSchedule"}


def test_toleration_seconds_count_control_plane_time_across_a_clock_jump(client_user, node, time_machine):
    """A forward clock jump inside the toleration (an NTP step, a restored VM) is paused like every
    other deadline (fleet.clock): the lease keeps the rest of its toleration after the jump."""
    from fleet import clock

    toleration = [{"key": "maintenance", "operator": "Exists", "effect": "NoExecute", "toleration_seconds": 600}]
    time_machine.move_to(timezone.now(), tick=False)
    clock.observe()
    lease = grant(client_user, "patient", toleration)
    pool = Pool.objects.get(pk=node.pool_id)
    pool_update(pool_id=pool.pk, expected_version=pool.version, changes={"taints": [TAINT]}, actor=Actor.system("t"))
    run_for(time_machine, 300)
    assert evict_noexecute() == 0  # 300 s of 600 used
    time_machine.shift(2 * 3600)  # the clock jumps two hours
    assert evict_noexecute() == 0  # the gap, less one sweep interval (5 s), is paused, not spent
    run_for(time_machine, 290)
    assert evict_noexecute() == 0  # 595 s of control-plane time
    run_for(time_machine, 10)
    assert evict_noexecute() == 1
    assert Lease.objects.get(pk=lease.pk).state == LeaseState.REVOKED


def test_a_lease_that_cannot_be_evicted_does_not_keep_the_others_running(client_user, node, monkeypatch, caplog):
    from leases import sweeps

    first, second = grant(client_user, "first"), grant(client_user, "second")
    taint(node, TAINT)
    end_lease = sweeps.end_lease

    def fails_for_the_first(lease_id, **kwargs):
        if lease_id == first.pk:
            raise RuntimeError("a deadlock victim")
        return end_lease(lease_id, **kwargs)

    monkeypatch.setattr(sweeps, "end_lease", fails_for_the_first)
    assert evict_noexecute() == 1
    assert Lease.objects.get(pk=second.pk).state == LeaseState.REVOKED
    assert Lease.objects.get(pk=first.pk).state != LeaseState.REVOKED
    assert f"could not evict lease {first.pk}" in caplog.text


def test_a_lease_stored_with_an_endless_toleration_does_not_stop_the_sweep(client_user, node):
    """toleration_seconds beyond a datetime's reach (accepted before the request bounded it) made
    the sweep raise OverflowError, so no lease was evicted any more; such a spec no longer
    validates, and its lease is judged without tolerations like any other such spec."""
    grant(client_user, "plain")  # no toleration: evicted at once, if the sweep gets to it
    endless = grant(client_user, "endless", [{"key": "maintenance", "operator": "Exists", "effect": "NoExecute"}])
    spec = {**endless.spec, "tolerations": [{**endless.spec["tolerations"][0], "toleration_seconds": 10**15}]}
    Lease.objects.filter(pk=endless.pk).update(spec=spec)
    taint(node, TAINT)
    assert evict_noexecute() == 2
    assert set(Lease.objects.values_list("state", flat=True)) == {LeaseState.REVOKED}
