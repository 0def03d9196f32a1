"""The device rules in SQL (leases.sql.devices.device_rule_sql) decide as leases.device_requests.choose
does: on random nodes (models, memory, groups, health, verification, holds, live holds) and random
requests, the SQL reason code equals choose's, on SQLite and PostgreSQL alike; and placement and
the 409 built on it give what the Python path gives."""

from __future__ import annotations

import pytest
from django.db import connection, transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.devices import refresh_fingerprints
from fleet.models import Device, Node
from leases import devices as lease_devices
from leases import placement
from leases.device_requests import choose, parse_device_requests
from leases.models import LeaseDevice
from leases.services import resolve_shape
from leases.spec import parse_spec
from leases.sql import devices as device_sql
from tests.device_support import A100, H100, make_gpu_node
from tests.factories import PoolFactory
from tests.support import grant

pytestmark = pytest.mark.django_db

device_strategy = st.fixed_dictionaries(
    {
        "model": st.sampled_from([H100, A100, "H100_PCIe%x"]),
        "memory_bytes": st.sampled_from([None, 40 * 2**30, 80 * 2**30]),
        "interconnect_group": st.sampled_from(["", "nvlink-0", "nvlink-1"]),
        "numa_node": st.sampled_from([None, 0, 1]),
        "health": st.sampled_from(["healthy", "unknown", "unhealthy", "missing"]),
        "verified": st.booleans(),
        "held": st.booleans(),
        "hard_tainted": st.booleans(),
        "taken": st.booleans(),
    }
)
constraint_strategy = st.sampled_from(
    [
        {"attribute": "model", "operator": "glob", "value": "*H100*"},
        {"attribute": "model", "operator": "glob", "value": "NVIDIA ?100*"},
        {"attribute": "model", "operator": "glob", "value": "H100_PCIe%?"},
        {"attribute": "model", "operator": "=", "value": A100},
        {"attribute": "model", "operator": "!=", "value": A100},
        {"attribute": "memory", "operator": ">=", "value": "80Gi"},
        {"attribute": "memory", "operator": "<", "value": "40.5Gi"},
        {"attribute": "memory", "operator": "!=", "value": "40Gi"},
        {"attribute": "numa_node", "operator": "=", "value": 1},
        {"attribute": "interconnect_group", "operator": "glob", "value": "nvlink-*"},
        {"attribute": "index", "operator": "<=", "value": 2},
    ]
)
request_strategy = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["nvidia.com/gpu", "amd.com/gpu"]),
        "count": st.integers(1, 4),
        "constraints": st.lists(constraint_strategy, max_size=2),
        "colocate": st.sampled_from(["", "interconnect_group", "numa_node"]),
    }
)


def sql_reason(request, node_pk, rule=device_sql.device_rule_sql) -> str:
    table = connection.ops.quote_name("fleet_node")
    sql, params = rule(request, f"{table}.{connection.ops.quote_name('id')}")
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {sql} FROM {table} WHERE id = %s",
            [*params, node_pk.hex if connection.vendor == "sqlite" else node_pk],
        )
        return cursor.fetchone()[0]


def set_reason(request, node_pk) -> str:
    """The node's reason as the census reads it: joined to device_reasons_sql's table."""
    nodes, reason = device_sql.join_device_reasons(
        Node.objects.filter(pk=node_pk), request, Node.objects.get(pk=node_pk).pool_id
    )
    return nodes.annotate(reason=reason).values_list("reason", flat=True).get()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(described=st.lists(device_strategy, min_size=0, max_size=6), wire=request_strategy, implicit=st.booleans())
def test_the_device_rules_in_sql_give_the_reason_choose_gives(client_user, described, wire, implicit):
    with transaction.atomic():
        pool = PoolFactory(name="gpu")
        node, _ = make_gpu_node(pool, count=len(described))
        holder = grant(client_user, "holder", pool="gpu", cpu="1")
        rows = list(Device.objects.filter(node=node).order_by("index"))
        now = timezone.now()
        for row, want in zip(rows, described, strict=True):
            Device.objects.filter(pk=row.pk).update(
                model=want["model"], memory_bytes=want["memory_bytes"], interconnect_group=want["interconnect_group"],
                numa_node=want["numa_node"], health=want["health"], held=want["held"],
                hard_tainted=want["hard_tainted"], verified_at=now if want["verified"] else None,
            )  # fmt: skip
            if want["taken"]:  # a hold as leases.devices.claim writes it: the row and its mirror
                LeaseDevice.objects.create(lease=holder, device=row)
                Device.objects.filter(pk=row.pk).update(claimed=True)
        request = parse_device_requests([wire])[0]
        if implicit:
            request = type(request)(request.type, request.count, implicit=True)
        devices, taken = lease_devices.node_devices([node.pk], None)
        expected = choose((request,), devices.get(node.pk, []), taken.get(node.pk, set())).code
        assert sql_reason(request, node.pk) == expected
        # The 409's set-based form of the same rules (every node of the pool at once).
        assert set_reason(request, node.pk) == expected
        transaction.set_rollback(True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(described=st.lists(device_strategy, min_size=0, max_size=6), wire=request_strategy, implicit=st.booleans())
def test_the_claim_picks_the_devices_choose_picks(client_user, described, wire, implicit):
    """leases.devices.claim (one statement on PostgreSQL for a plain request, the Python path
    otherwise) holds exactly the devices choose picks, in its order, or refuses when choose does."""
    with transaction.atomic():
        pool = PoolFactory(name="gpu")
        node, _ = make_gpu_node(pool, count=len(described))
        holder = grant(client_user, "holder", pool="gpu", cpu="1")
        claimant = grant(client_user, "claimant", pool="gpu", cpu="1")
        now = timezone.now()
        for row, want in zip(Device.objects.filter(node=node).order_by("index"), described, strict=True):
            Device.objects.filter(pk=row.pk).update(
                model=want["model"], memory_bytes=want["memory_bytes"], interconnect_group=want["interconnect_group"],
                numa_node=want["numa_node"], health=want["health"], held=want["held"],
                hard_tainted=want["hard_tainted"], verified_at=now if want["verified"] else None,
            )  # fmt: skip
            if want["taken"]:
                LeaseDevice.objects.create(lease=holder, device=row)
                Device.objects.filter(pk=row.pk).update(claimed=True)
        request = parse_device_requests([wire])[0]
        if implicit:
            request = type(request)(request.type, request.count, implicit=True)
        devices, taken = lease_devices.node_devices([node.pk], None)
        expected = choose((request,), devices.get(node.pk, []), taken.get(node.pk, set()))
        try:
            got = lease_devices.claim(lease=claimant, node_id=node.pk, requests=(request,))
        except lease_devices.NoDevices:
            got = None
        if expected.code:
            assert got is None
        else:
            assert got == [{"id": d["device_id"], "type": d["type"], "index": d["index"]} for d in expected.picked]
            held = LeaseDevice.objects.filter(lease=claimant, live=True).order_by("position")
            assert [ld.device.device_id for ld in held] == [d["id"] for d in got]
            assert set(Device.objects.filter(claimed=True).values_list("device_id", flat=True)) >= {
                d["id"] for d in got
            }
        transaction.set_rollback(True)


def test_placement_and_the_409_decided_in_sql_agree_with_the_python_path(client_user):
    pool = PoolFactory(name="gpu")
    for tag in ("h1", "h2"):
        make_gpu_node(pool, tag=tag, count=4)
    make_gpu_node(pool, tag="a1", count=4, model=A100, memory=40 * 2**30)
    Device.objects.filter(device_id__startswith="GPU-h2-", index__gte=2).update(interconnect_group="nvlink-9")
    # Written past sync_counts (as an agent's report would not be): the fingerprints follow by hand.
    assert refresh_fingerprints(Node.objects.filter(pool=pool)) == 1
    h100 = {"attribute": "model", "operator": "glob", "value": "*H100*"}
    small = {"attribute": "memory", "operator": "<", "value": "50Gi"}
    bracket = {"attribute": "model", "operator": "glob", "value": "[A-Z]*"}
    for devices in (
        [{"type": "nvidia.com/gpu", "count": 3, "constraints": [h100], "colocate": "interconnect_group"}],
        [{"type": "nvidia.com/gpu", "count": 2, "constraints": [h100]}],
        [{"type": "nvidia.com/gpu", "count": 4, "colocate": "numa_node"}],
        [{"type": "nvidia.com/gpu", "count": 1, "constraints": [small]}],
    ):  # fmt: skip
        spec = resolve_shape(parse_spec({"workload_id": "w", "pool": "gpu", "devices": devices}))[0]
        assert device_sql.decided_in_sql(spec)
        in_sql = {c.node.hostname for c in placement.find_candidates(pool, spec).candidates}
        # The same request with a bracket glob that means the same is decided in Python.
        python_devices = [dict(d, constraints=[*d.get("constraints", []), bracket]) for d in devices]
        python_spec = resolve_shape(parse_spec({"workload_id": "w", "pool": "gpu", "devices": python_devices}))[0]
        assert not device_sql.decided_in_sql(python_spec)
        in_python = {c.node.hostname for c in placement.find_candidates(pool, python_spec).candidates}
        assert in_sql == in_python
        assert placement.diagnose(pool, spec)["reasons"] == placement.diagnose(pool, python_spec)["reasons"]


operation_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("gpus"), st.integers(1, 3)),
        st.tuples(st.just("slice"), st.integers(1, 2)),
        st.tuples(st.just("end"), st.integers(0, 20)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=operation_strategy)
def test_the_claimed_mirror_agrees_with_the_live_holds_after_any_grants_and_releases(client_user, operations):
    """Grants of whole GPUs and of MIG slices and lease ends in any order, through the services:
    every device's ``claimed`` equals its recomputation from the live holds after each step."""
    from fleet.devices import counted, sync_counts
    from fleet.events import Actor
    from fleet.models import Node, NodeResource
    from leases.lifecycle import end_lease
    from leases.models import Lease
    from tests.device_support import claimed_disagreements, gpu, report_devices
    from tests.support import grant_status

    with transaction.atomic():
        pool = PoolFactory(name="gpu")
        node, _ = make_gpu_node(pool, count=4)
        parent = Device.objects.get(node=node, index=0)
        migs = [{"id": f"MIG-{i}", "type": "nvidia.com/mig", "index": i, "mig_profile": "1g.10gb",
                 "parent": parent.device_id} for i in range(2)]  # fmt: skip
        report_devices(node, [gpu(i) for i in range(4)] + migs)
        Device.objects.filter(node=node).update(verified_at=parent.verified_at)
        sync_counts(Node.objects.select_related("pool").get(pk=node.pk))
        for step, (kind, amount) in enumerate(operations):
            if kind == "end":
                live = list(Lease.objects.filter(state="granted").order_by("granted_at", "pk"))
                if live:
                    lease = live[amount % len(live)]
                    end_lease(lease.pk, to_state="released", reason="t", now=timezone.now(), actor=Actor.system("t"))
            else:
                resource = "nvidia.com/gpu" if kind == "gpus" else "nvidia.com/mig"
                grant_status(client_user, f"w{step}", pool="gpu", cpu="1", resources={resource: amount})
            assert claimed_disagreements() == [], (step, kind, amount)
            # A GPU and its MIG instances exclude each other in the counts too: each count
            # resource's free amount is the allocatable devices of its type nobody has claimed.
            for row in NodeResource.objects.filter(node=node, name__contains="/"):
                free = Device.objects.filter(counted(), node=node, type=row.name, claimed=False).count()
                assert row.allocatable - row.allocated == free, (step, kind, amount, row.name)
        transaction.set_rollback(True)


fingerprint_step = st.one_of(
    st.tuples(st.just("grant"), st.integers(1, 4), st.sampled_from(["", "interconnect_group"])),
    st.tuples(st.just("end"), st.integers(0, 20), st.just("")),
    st.tuples(st.just("taint"), st.integers(0, 19), st.sampled_from(["NoSchedule", "NoExecute", "PreferNoSchedule"])),
    st.tuples(st.just("untaint"), st.integers(0, 19), st.just("")),
    st.tuples(st.just("xid"), st.integers(0, 19), st.sampled_from(["79", "94", "48"])),
    st.tuples(st.just("unverify"), st.integers(0, 19), st.just("")),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(fingerprint_step, min_size=1, max_size=8),
    requests=st.lists(request_strategy, min_size=1, max_size=3),
)
def test_the_409_decides_alike_nodes_once_and_still_gives_each_node_its_own_reason(client_user, steps, requests):
    """Five nodes, three of them alike (one device fingerprint), changed through the services
    only (grants and ends, operator taints, XID reports, an inventory change): after every step
    each node's stored fingerprint is its devices' (sync_counts keeps it), and the census' device
    reasons, decided once per fingerprint and per node only where a lease holds devices, equal
    what choose gives on each node's own devices."""
    from fleet.devices import device_taint, device_untaint, fingerprint_drift
    from fleet.events import Actor
    from leases.lifecycle import end_lease
    from leases.models import Lease
    from tests.device_support import gpu, report_devices
    from tests.support import grant_status

    actor = Actor.system("t")
    with transaction.atomic():
        pool = PoolFactory(name="gpu")
        nodes = [make_gpu_node(pool, tag=f"h{i}", count=4)[0] for i in range(3)]
        nodes.append(make_gpu_node(pool, tag="a", count=4, model=A100, memory=40 * 2**30)[0])
        nodes.append(make_gpu_node(pool, tag="g", count=4, group="nvlink-7")[0])
        tags = ["h0", "h1", "h2", "a", "g"]
        assert len({n.device_fingerprint for n in Node.objects.filter(pool=pool)}) == 3
        for step, (kind, number, option) in enumerate(steps):
            node, tag, index = nodes[number % 5], tags[number % 5], number // 5
            device_id = f"GPU-{tag}-{index:04d}"
            if kind == "grant":
                wire = {"type": "nvidia.com/gpu", "count": number}
                if option:
                    wire["colocate"] = option
                grant_status(client_user, f"w{step}", pool="gpu", cpu="1", devices=[wire])
            elif kind == "end":
                live = list(Lease.objects.filter(state="granted").order_by("granted_at", "pk"))
                if live:
                    lease = live[number % len(live)]
                    end_lease(lease.pk, to_state="released", reason="t", now=timezone.now(), actor=actor)
            elif kind == "taint":
                device_taint(node_id=node.pk, device_id=device_id, key="t", effect=option, reason="t", actor=actor)
            elif kind == "untaint":
                row = Device.objects.get(device_id=device_id, retired_at__isnull=True)
                if any(t["key"] == "t" for t in row.taints):
                    device_untaint(node_id=node.pk, device_id=device_id, key="t", reason="t", actor=actor)
            else:
                model = A100 if tag == "a" else H100
                memory = 40 * 2**30 if tag == "a" else 80 * 2**30
                group = {"group": "nvlink-7"} if tag == "g" else {}
                wire = [gpu(i, node=tag, model=model, memory=memory, **group) for i in range(4)]
                if kind == "xid":
                    wire[index]["health"] = {"xid_events": [{"xid": int(option), "at": "2026-12-02T10:00:00Z"}]}
                else:  # more memory than verified: the device is not verified any more
                    wire[index]["memory_bytes"] = memory * 2
                report_devices(node, wire)
            assert fingerprint_drift(Node.objects.filter(pool=pool)) == 0, (step, kind)
        for wire in requests:
            request = parse_device_requests([wire])[0]
            devices, taken = lease_devices.node_devices([n.pk for n in nodes], None)
            nodes_with_reasons, reason = device_sql.join_device_reasons(
                Node.objects.filter(pool=pool), request, pool.pk
            )
            got = dict(nodes_with_reasons.annotate(reason=reason).values_list("pk", "reason"))
            for node in nodes:
                expected = choose((request,), devices.get(node.pk, []), taken.get(node.pk, set())).code
                assert got[node.pk] == expected, (wire, node.hostname)
        transaction.set_rollback(True)


def test_a_node_whose_devices_are_held_is_not_answered_for_by_its_alike_neighbours(client_user):
    """Three alike nodes (one fingerprint); a lease takes all four GPUs of one of them: that node
    alone has no free GPU, whichever of the three is the fingerprint's representative."""
    pool = PoolFactory(name="gpu")
    nodes = [make_gpu_node(pool, tag=f"h{i}", count=4)[0] for i in range(3)]
    assert len({n.device_fingerprint for n in Node.objects.filter(pool=pool)}) == 1
    lease = grant(client_user, "all-four", pool="gpu", devices=[{"type": "nvidia.com/gpu", "count": 4}])
    request = parse_device_requests([{"type": "nvidia.com/gpu", "count": 1}])[0]
    joined, reason = device_sql.join_device_reasons(Node.objects.filter(pool=pool), request, pool.pk)
    got = dict(joined.annotate(reason=reason).values_list("pk", "reason"))
    assert got == {n.pk: ("device_not_free" if n.pk == lease.node_id else "") for n in nodes}
