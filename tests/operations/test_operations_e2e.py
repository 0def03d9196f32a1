"""Pool operations end to end: a live server, simulated nodes talking HTTP to it, and a REAL Celery
worker (not eager) running the upgrade tick chain, admission, autoscaling and preemption tasks.

Short timings (1 s heartbeats, a 0.3 s upgrade tick, zero soak) keep the 20-node roll under a minute.
"""

from __future__ import annotations

import os
import time

import pytest
from django.db import connection
from django.utils import timezone

from fleet.choices import AdmissionMode, Lifecycle, Liveness
from fleet.models import Event, Node
from operations.choices import UpgradeState
from operations.models import Upgrade, UpgradeNode
from simulator import FleetSimulator, FleetThread, PoolSpec
from tests.factories import PoolFactory
from tests.fleet_support import make_token
from tests.operations_support import Stack
from tests.processes import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# CI budget (issue 15: at most 6 minutes added): the 20-node roll runs on both databases; the
# other three end-to-end tests run on PostgreSQL in CI. They pass on SQLite too — run them there
# with NODEPOOL_E2E_ALL_DATABASES=1.
postgres_in_ci = pytest.mark.skipif(
    connection.vendor == "sqlite" and not os.environ.get("NODEPOOL_E2E_ALL_DATABASES"),
    reason="CI budget: on SQLite only the 20-node roll runs (set NODEPOOL_E2E_ALL_DATABASES=1 for all)",
)
TARGET = {"version": "2.0.0", "artifact": {"ref": "https://artifacts.example/agent-2.0.0.whl", "sha256": "b" * 64}}


def unavailable(pool) -> int:
    """Members not ready, cordoned, not alive or not reporting ready: the operator's view of 'out of service'."""
    members = Node.objects.filter(pool=pool).exclude(lifecycle=Lifecycle.RETIRED)
    return members.exclude(lifecycle=Lifecycle.READY, cordoned=False, liveness=Liveness.ALIVE, ready=True).count()


def simulated_pool(live_server, name: str, count: int, stack_log):
    pool = PoolFactory(
        name=name, heartbeat_interval=1, heartbeat_grace=30, loss_threshold=120, admission_mode=AdmissionMode.AUTOMATIC
    )
    sim = FleetSimulator(
        live_server.url,
        pools=[PoolSpec(name, make_token(pool, max_uses=count))],
        seed=7,
        progress=False,
        max_backoff=2.0,
    )
    fleet = FleetThread(sim).open()
    fleet.enroll(count)
    fleet.start()
    wait_for(
        lambda: (
            Node.objects.filter(pool=pool, lifecycle=Lifecycle.READY, liveness=Liveness.ALIVE, ready=True).count()
            == count
        ),
        60,
        f"{count} admitted nodes",
        stack_log,
    )
    return pool, fleet


def start_upgrade(api, pool, **fields) -> str:
    body = {"pool": pool.name, "target": TARGET, "soak_seconds": 0, "node_timeout": 60, **fields}
    created = api.post("/api/v1/upgrades", body, format="json")
    assert created.status_code == 201, created.content
    started = api.post(
        f"/api/v1/upgrades/{created.json()['id']}/start",
        {},
        format="json",
        HTTP_IF_MATCH=f'"{created.json()["version"]}"',
    )
    assert started.status_code == 200, started.content
    return created.json()["id"]


def test_a_twenty_node_roll_never_has_more_than_two_unavailable(live_server, operator_api, tmp_path):
    stack = Stack(tmp_path)
    with stack.running():
        pool, fleet = simulated_pool(live_server, "roll", 20, stack.log)
        try:
            upgrade_id = start_upgrade(operator_api, pool, max_unavailable_nodes="2", canary_nodes=2)
            began, samples, peak = time.monotonic(), 0, 0
            while time.monotonic() - began < 90:
                peak = max(peak, unavailable(pool))
                samples += 1
                if Upgrade.objects.get(pk=upgrade_id).state == UpgradeState.COMPLETED:
                    break
                time.sleep(0.05)
            elapsed = time.monotonic() - began
            versions = {n.agent_version for n in fleet.sim.nodes.values()}
        finally:
            fleet.close()

    upgrade = Upgrade.objects.get(pk=upgrade_id)
    trail = list(
        Event.objects.filter(subject_type="upgrade", subject_id=str(upgrade.pk))
        .order_by("created_at")
        .values_list("reason", flat=True)
    )
    # The first failure's reason, not only the state it led to (a rollback overwrites status_reason).
    failures = [reason for reason in trail if "fail" in reason]
    assert upgrade.state == UpgradeState.COMPLETED, (failures[:3], upgrade.status_reason, stack.log_text()[-2000:])
    assert peak <= 2, f"{peak} nodes unavailable at once (max_unavailable_nodes=2)"
    assert peak == 2, "the roll used its budget"
    assert samples > 100
    # The roll takes well under a minute on an idle machine (docs/pool-operations.md); the bound here
    # only catches a stalled roll on a loaded CI machine (this is not a timing test).
    print(f"20-node roll: {elapsed:.1f}s, {samples} samples, peak unavailable {peak}")
    assert elapsed < 120, f"the 20-node roll took {elapsed:.1f}s"
    assert versions == {"2.0.0"}, "every simulated node restarted running the new version"
    nodes = Node.objects.filter(pool=pool)
    assert {(n.lifecycle, n.agent_version, n.cordoned) for n in nodes} == {("ready", "2.0.0", False)}
    assert all(n.incarnation >= 2 for n in nodes)
    assert UpgradeNode.objects.filter(upgrade=upgrade, state="done").count() == 20
    stack.assert_clean_log()


@postgres_in_ci
def test_canaries_that_fail_admission_roll_the_upgrade_back(live_server, operator_api, tmp_path):
    stack = Stack(tmp_path)
    with stack.running():
        pool, fleet = simulated_pool(live_server, "canary", 5, stack.log)
        try:
            for name in fleet.sim.nodes:
                fleet.break_upgrades(name)
            upgrade_id = start_upgrade(operator_api, pool, max_unavailable_nodes="2", canary_nodes=2)
            wait_for(
                lambda: Upgrade.objects.get(pk=upgrade_id).state == UpgradeState.ROLLED_BACK,
                60,
                "the rollback",
                stack.log,
            )
            wait_for(lambda: unavailable(pool) == 0, 20, "every node back in service", stack.log)
        finally:
            fleet.close()

    upgrade = Upgrade.objects.get(pk=upgrade_id)
    canaries = UpgradeNode.objects.filter(upgrade=upgrade, phase="canary")
    assert canaries.filter(state="failed").exists()
    assert all("admission refused" in row.detail for row in canaries.filter(state="failed"))
    assert not UpgradeNode.objects.filter(upgrade=upgrade, phase="roll").exclude(state="skipped").exists()
    assert {(n.lifecycle, n.agent_version) for n in Node.objects.filter(pool=pool)} == {("ready", "1.0.0")}
    stack.assert_clean_log()


def stop_machines() -> None:
    """Stop every simulator machine a test's provider started (they run in their own sessions)."""
    from operations.models import ProviderMachine
    from operations.providers import SimulatedProvider

    for machine in ProviderMachine.objects.exclude(provider_data={}):
        SimulatedProvider(url="").delete(machine.name, machine.provider_data)


def lease_body(workload_id, cpu, seconds, **extra):
    return {
        "workload_id": workload_id,
        "pool": "elastic",
        "resources": {"cpu": cpu, "memory": "256Mi"},
        "command": ["sleep", str(seconds)],
        "queue": True,
        "ttl_seconds": 600,
        **extra,
    }


@postgres_in_ci
def test_autoscaling_adds_nodes_for_pending_demand_and_removes_idle_ones_within_a_budget(
    live_server, operator_api, client_api, tmp_path
):
    from leases.models import Lease
    from maintenance.budgets import budget_status
    from maintenance.models import DisruptionBudget
    from operations.models import ProviderMachine, ScaleDecision
    from operations.tasks import autoscale

    pool = PoolFactory(
        name="elastic",
        heartbeat_interval=1,
        heartbeat_grace=30,
        loss_threshold=120,
        admission_mode=AdmissionMode.AUTOMATIC,
    )
    settings_body = {
        "provider": "simulated",
        "provider_url": live_server.url,
        "min_nodes": 1,
        "max_nodes": 3,
        "node_template": {"resources": {"cpu": "4", "memory": "8Gi"}},
        "scale_up_delay": 0,
        "scale_up_cooldown": 0,
        "scale_down_after": 2,
        "scale_down_cooldown": 1,
        "scale_down_utilization": 0.2,
        "drain_policy": "checkpoint",
        "drain_timeout": 30,
        "boot_timeout": 60,
    }
    assert (
        operator_api.patch(
            "/api/v1/pools/elastic/operations", settings_body, format="json", HTTP_IF_MATCH='"1"'
        ).status_code
        == 200
    )
    budget = DisruptionBudget.objects.create(group="db", max_unavailable=1)
    stack = Stack(tmp_path)
    worst_disrupted, most_machines = 0, 0

    def machines(*states):
        return ProviderMachine.objects.filter(pool=pool, state__in=states).count()

    def state() -> str:
        from fleet.models import NodeResource
        from fleet.selectors import unschedulable_reasons
        from leases.models import LeaseRequest

        nodes = [
            (n.hostname, n.lifecycle, n.liveness, n.ready, n.health, unschedulable_reasons(n))
            for n in Node.objects.filter(pool=pool)
        ]
        resources = NodeResource.objects.filter(node__pool=pool, name__in=["cpu", "memory"]).values_list(
            "node__hostname", "name", "capacity", "allocatable", "allocated"
        )
        requests = LeaseRequest.objects.values_list("workload_id", "state", "attempts", "last_attempt_at", "reasons")
        return "\n".join(
            [
                f"machines: {list(ProviderMachine.objects.filter(pool=pool).values_list('name', 'state'))}",
                f"nodes: {nodes}",
                f"resources: {list(resources)}",
                f"leases: {list(Lease.objects.values_list('workload_id', 'state', 'outcome', 'node__hostname'))}",
                f"requests: {list(requests)}",
                f"decisions: {list(ScaleDecision.objects.values_list('direction', 'outcome', 'count', 'reason'))[-6:]}",
            ]
        )

    def pass_and_sample():
        nonlocal worst_disrupted, most_machines
        autoscale.delay()
        worst_disrupted = max(worst_disrupted, budget_status(budget, now=timezone.now()).disrupted)
        most_machines = max(most_machines, machines("requested", "enrolled", "ready"))
        time.sleep(0.5)

    try:
        with stack.running(NODEPOOL_SIMULATED_MACHINE_LIFETIME="180"):
            wait_for(
                lambda: pass_and_sample() or machines("ready") == 1,
                120,
                "the min_nodes machine",
                stack.log,
                state=state,
            )
            for n in (1, 2):
                body = lease_body(
                    f"db-{n}", "500m", 600, spread={"group": "db", "topology_key": "kubernetes.io/hostname"}
                )
                response = client_api.post("/api/v1/node-leases", body, format="json")
                assert response.status_code in (201, 202), response.content
            for n in range(3):
                response = client_api.post("/api/v1/node-leases", lease_body(f"batch-{n}", "3", 4), format="json")
                assert response.status_code in (201, 202), response.content
            wait_for(
                lambda: (
                    pass_and_sample()
                    or Lease.objects.filter(workload_id__startswith="batch", outcome="succeeded").count() == 3
                ),
                180,
                "three batch leases done on new nodes",
                stack.log,
                state=state,
            )
            assert most_machines >= 3
            wait_for(
                lambda: pass_and_sample() or (machines("ready") == 1 and not machines("draining")),
                180,
                "idle machines removed",
                stack.log,
                state=state,
            )
            live_db = Lease.objects.filter(workload_id__startswith="db-", state__in=["granted", "active"])
            wait_for(lambda: live_db.count() == 2, 60, "the db workloads placed again", stack.log, state=state)
    finally:
        stop_machines()

    assert worst_disrupted <= 1, "the db group's disruption budget (max_unavailable=1) held at every sample"
    ups = ScaleDecision.objects.filter(pool=pool, direction="up", outcome="succeeded")
    downs = ScaleDecision.objects.filter(pool=pool, direction="down", outcome="requested")
    assert ups.count() >= 2 and downs.count() >= 2
    assert any("pending" in d.reason for d in ups) and any("min_nodes" in d.reason for d in ups)
    ready_times = [m.scale_up_seconds for m in ProviderMachine.objects.filter(pool=pool, ready_at__isnull=False)]
    assert len(ready_times) >= 3 and all(0 < t < 60 for t in ready_times)
    assert Node.objects.filter(pool=pool).exclude(lifecycle="retired").count() == 1
    stack.assert_clean_log()


@postgres_in_ci
def test_a_preemption_notice_moves_the_work_to_the_fallback_pool_before_the_deadline(
    live_server, operator_api, client_api, tmp_path
):
    from leases.models import Lease, LeaseRequest
    from operations.models import Preemption

    pools = {}
    for name in ("spot", "ondemand"):
        pools[name] = PoolFactory(
            name=name,
            heartbeat_interval=1,
            heartbeat_grace=30,
            loss_threshold=120,
            admission_mode=AdmissionMode.AUTOMATIC,
        )
    assert (
        operator_api.patch(
            "/api/v1/pools/spot/operations",
            {"spot": True, "fallback_pool": "ondemand"},
            format="json",
            HTTP_IF_MATCH='"1"',
        ).status_code
        == 200
    )
    stack = Stack(tmp_path)
    fleets = []
    with stack.running():
        try:
            for name, pool in pools.items():
                pool.refresh_from_db()
                sim = FleetSimulator(
                    live_server.url,
                    pools=[PoolSpec(name, make_token(pool, max_uses=1))],
                    seed=3,
                    progress=False,
                    max_backoff=2.0,
                )
                fleet = FleetThread(sim).open()
                fleets.append(fleet)
                fleet.enroll(1)
                fleet.start()
            wait_for(
                lambda: Node.objects.filter(lifecycle="ready", liveness="alive", ready=True).count() == 2,
                60,
                "both nodes admitted",
                stack.log,
            )
            body = {
                "workload_id": "train-1",
                "pool": "spot",
                "resources": {"cpu": "1", "memory": "256Mi"},
                "command": ["sleep", "600"],
                "ttl_seconds": 600,
                "tolerations": [{"key": "nodepool.dev/spot", "operator": "Exists", "effect": "NoSchedule"}],
            }
            granted = client_api.post("/api/v1/node-leases", body, format="json")
            assert granted.status_code == 201, granted.content
            old = Lease.objects.get(pk=granted.json()["id"])
            wait_for(lambda: Lease.objects.get(pk=old.pk).state == "active", 20, "the lease running", stack.log)

            spot_fleet = fleets[0]
            name = next(iter(spot_fleet.sim.nodes))
            assert spot_fleet.preempt(name, 20) == 201
            deadline = Preemption.objects.get().deadline
            wait_for(
                lambda: Lease.objects.filter(
                    workload_id="train-1", pool__name="ondemand", state__in=["granted", "active"]
                ).exists(),
                25,
                "the work placed in the fallback pool",
                stack.log,
            )
            moved_at = timezone.now()
        finally:
            for fleet in fleets:
                fleet.close()

    new = Lease.objects.get(workload_id="train-1", pool__name="ondemand")
    old.refresh_from_db()
    assert moved_at < deadline, "the work moved before the deadline"
    assert new.granted_at < deadline
    assert (old.state, old.superseded_by_id) == ("revoked", new.pk)
    assert new.fencing_token > old.fencing_token
    assert LeaseRequest.objects.get(requeued_from=old).lease_id == new.pk
    assert Preemption.objects.get().leases_requeued == 1
    stack.assert_clean_log()
