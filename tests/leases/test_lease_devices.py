"""Grants assign specific devices atomically; requests select devices by attribute."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction

from fleet.events import Actor
from fleet.models import Device
from leases.models import Lease, LeaseDevice
from leases.services import lease_create
from tests.device_support import A100, gpu, make_gpu_node, report_devices
from tests.factories import PoolFactory
from tests.support import grant_status

pytestmark = pytest.mark.django_db


def grant(user, workload_id, **body):
    data = {"workload_id": workload_id, "pool": "gpu", **body}
    lease, status = lease_create(data=data, client=user, actor=Actor.system("test"))
    return lease, status


def test_two_four_gpu_leases_get_four_different_gpus_each(client_user, client_api):
    node, _ = make_gpu_node(PoolFactory(name="gpu"))
    first, _ = grant(client_user, "a", resources={"nvidia.com/gpu": 4})
    second, _ = grant(client_user, "b", resources={"nvidia.com/gpu": 4})
    ids = [d["id"] for d in first.devices] + [d["id"] for d in second.devices]
    assert len(ids) == 8 and len(set(ids)) == 8
    shown = client_api.get(f"/api/v1/node-leases/{first.pk}").json()["devices"]
    assert shown == first.devices and shown[0] == {"id": "GPU-n-0000", "type": "nvidia.com/gpu", "index": 0}
    assert grant_status(client_user, "c", pool="gpu", cpu="1", resources={"nvidia.com/gpu": 1}) == 409


def test_releasing_a_lease_frees_its_devices(client_user, client_api):
    make_gpu_node(PoolFactory(name="gpu"), count=4)
    lease, _ = grant(client_user, "a", resources={"nvidia.com/gpu": 4})
    response = client_api.post(
        f"/api/v1/node-leases/{lease.pk}/release",
        {"fencing_token": lease.fencing_token, "node_incarnation": lease.node_incarnation}, format="json",
    )  # fmt: skip
    assert response.status_code == 200, response.content
    assert not LeaseDevice.objects.filter(live=True).exists()
    again, status = grant(client_user, "b", resources={"nvidia.com/gpu": 4})
    assert status == 201 and len(again.devices) == 4


def test_the_agent_learns_the_devices_with_its_lease(client_user, no_flood_guard):
    from tests.heartbeat_support import beat
    from tests.support import node_api

    node, secret = make_gpu_node(PoolFactory(name="gpu"))
    lease, _ = grant(client_user, "a", resources={"nvidia.com/gpu": 2}, command=["train"])
    response = node_api(secret).post(f"/api/v1/nodes/{node.pk}/heartbeats", beat(), format="json")
    assigned = response.json()["leases"]
    entry = next(item for item in assigned if item["lease_id"] == str(lease.pk))
    assert [d["id"] for d in entry["devices"]] == ["GPU-n-0000", "GPU-n-0001"]


def test_the_database_refuses_two_live_leases_on_one_device(client_user):
    make_gpu_node(PoolFactory(name="gpu"), count=1)
    lease, _ = grant(client_user, "a", resources={"nvidia.com/gpu": 1})
    other, _ = grant(client_user, "b", resources={"cpu": "1"})
    device = Device.objects.get(device_id=lease.devices[0]["id"])
    with pytest.raises(IntegrityError), transaction.atomic():
        LeaseDevice.objects.create(lease=other, device=device)


def test_a_gpu_and_its_mig_instances_exclude_each_other(client_user):
    node, _ = make_gpu_node(PoolFactory(name="gpu"), count=1)
    parent = Device.objects.get(node=node)
    migs = [
        {"id": f"MIG-{i}", "type": "nvidia.com/mig", "index": i, "mig_profile": "3g.40gb", "parent": parent.device_id,
         "model": parent.model, "memory_bytes": 40 * 2**30}
        for i in range(2)
    ]  # fmt: skip
    report_devices(node, [gpu(0), *migs])
    Device.objects.filter(node=node).update(verified_at=parent.verified_at)
    from fleet.devices import sync_counts
    from fleet.models import Node

    sync_counts(Node.objects.get(pk=node.pk))
    whole, status = grant(client_user, "whole", resources={"nvidia.com/gpu": 1})
    assert status == 201
    profile = {"attribute": "mig_profile", "operator": "=", "value": "3g.40gb"}
    slice_request = [{"type": "nvidia.com/mig", "count": 1, "constraints": [profile]}]
    assert grant_status(client_user, "slice", pool="gpu", cpu="1", devices=slice_request) == 409
    from django.utils import timezone

    from leases.lifecycle import end_lease

    end_lease(whole.pk, to_state="released", reason="done", now=timezone.now(), actor=Actor.system("test"))
    sliced, status = grant(
        client_user, "slice", devices=[{"type": "nvidia.com/mig", "count": 1}], resources={"cpu": "1"}
    )
    assert status == 201 and sliced.devices[0]["id"] == "MIG-0"
    # the whole GPU is now out of reach: its slice is in use
    assert grant_status(client_user, "whole-2", pool="gpu", cpu="1", resources={"nvidia.com/gpu": 1}) == 409


def test_requests_select_devices_by_memory_model_and_interconnect_group(client_user):
    pool = PoolFactory(name="gpu")
    make_gpu_node(pool, tag="small", model=A100, memory=40 * 2**30)
    big, _ = make_gpu_node(pool, tag="big")
    lease, status = grant(client_user, "a", devices=[{
        "type": "nvidia.com/gpu", "count": 2, "colocate": "interconnect_group",
        "constraints": [{"attribute": "memory", "operator": ">=", "value": "80Gi"},
                        {"attribute": "model", "operator": "glob", "value": "*H100*"}],
    }])  # fmt: skip
    assert status == 201 and lease.node_id == big.pk
    groups = {Device.objects.get(device_id=d["id"]).interconnect_group for d in lease.devices}
    assert len(groups) == 1


def test_colocation_refuses_devices_spread_over_groups(client_user):
    make_gpu_node(PoolFactory(name="gpu"), count=4, group=None)
    Device.objects.update(interconnect_group="")  # the host does not tell
    _, status = grant(client_user, "ok", devices=[{"type": "nvidia.com/gpu", "count": 2}])
    assert status == 201
    assert grant_status(client_user, "b", pool="gpu", cpu="1", devices=[
        {"type": "nvidia.com/gpu", "count": 2, "colocate": "interconnect_group"}]) == 409  # fmt: skip


@pytest.mark.parametrize(
    ("devices", "field", "code"),
    [
        ([{"type": "example.com/nothing", "count": 1}], "devices[0].type", "unknown_device_type"),
        ([{"type": "nvidia.com/gpu", "count": 0}], "devices[0].count", "invalid_device_request"),
        ([{"type": "nvidia.com/gpu", "constraints": [{"attribute": "memory", "operator": ">=", "value": "lots"}]}],
         "devices[0].constraints[0].value", "invalid_device_constraint"),
        ([{"type": "nvidia.com/gpu", "constraints": [{"attribute": "colour", "operator": "=", "value": "x"}]}],
         "devices[0].constraints[0].attribute", "invalid_device_constraint"),
        ([{"type": "nvidia.com/gpu", "constraints": [{"attribute": "memory", "operator": "glob", "value": "4*"}]}],
         "devices[0].constraints[0].operator", "invalid_device_constraint"),
        ([{"type": "nvidia.com/gpu", "colocate": "rack"}], "devices[0].colocate", "invalid_colocation"),
        ({"type": "nvidia.com/gpu"}, "devices", "invalid_device_request"),
    ],
)  # fmt: skip
def test_bad_device_requests_are_400_naming_the_field_and_store_nothing(client_api, devices, field, code):
    PoolFactory(name="gpu")
    response = client_api.post(
        "/api/v1/node-leases", {"workload_id": "w", "pool": "gpu", "devices": devices}, format="json"
    )
    assert response.status_code == 400, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    body = response.json()
    assert body["code"] == code and body["errors"][0]["field"] == field
    assert not Lease.objects.exists()


def test_a_count_that_disagrees_with_the_devices_is_refused(client_api):
    PoolFactory(name="gpu")
    response = client_api.post("/api/v1/node-leases", {
        "workload_id": "w", "pool": "gpu", "resources": {"nvidia.com/gpu": 2},
        "devices": [{"type": "nvidia.com/gpu", "count": 1}]}, format="json")  # fmt: skip
    assert response.status_code == 400 and response.json()["errors"][0]["field"] == "resources.nvidia.com/gpu"


def test_a_shape_carries_device_requests(operator_api, client_user):
    make_gpu_node(PoolFactory(name="gpu"))
    response = operator_api.post("/api/v1/shapes", {
        "name": "h100-pair", "resources": {"cpu": "4"},
        "devices": [{"type": "nvidia.com/gpu", "count": 2, "colocate": "numa_node"}]}, format="json")  # fmt: skip
    assert response.status_code == 201, response.content
    assert response.json()["resources"]["nvidia.com/gpu"] == 2
    lease, status = grant(client_user, "a", shape="h100-pair")
    assert status == 201 and len(lease.devices) == 2


def test_a_node_without_device_rows_keeps_the_plain_count(client_user):
    from tests.factories import make_schedulable_node

    make_schedulable_node(PoolFactory(name="gpu"), resources={"cpu": 8000, "memory": 2**34, "nvidia.com/gpu": 2})
    lease, status = grant(client_user, "a", resources={"nvidia.com/gpu": 2})
    assert status == 201 and lease.devices == []


def test_the_409_counts_device_reasons_per_node(client_api):
    pool = PoolFactory(name="gpu")
    for tag in ("a1", "a2"):
        make_gpu_node(pool, tag=tag, model=A100, memory=40 * 2**30)
    make_gpu_node(pool, tag="h", count=4, group="")
    Device.objects.filter(device_id__startswith="GPU-h-").update(interconnect_group="")
    body = {"workload_id": "w", "pool": "gpu", "devices": [{
        "type": "nvidia.com/gpu", "count": 2, "colocate": "interconnect_group",
        "constraints": [{"attribute": "model", "operator": "glob", "value": "*H100*"}]}]}  # fmt: skip
    response = client_api.post("/api/v1/node-leases", body, format="json")
    assert response.status_code == 409
    problem = response.json()
    assert problem["reasons"] == {"device_unmatched": 2, "device_not_colocated": 1}
    assert "2 node(s) had no nvidia.com/gpu matching model=*H100*" in problem["detail"]
    assert "1 node(s) had free nvidia.com/gpu only in different interconnect groups" in problem["detail"]


def test_the_409_decides_device_reasons_per_device_group_in_queries_that_do_not_grow_with_nodes(client_user):
    """Nodes whose devices differ only in which are held fall in different groups (the held ones
    fail on freedom, the other on colocation); more alike nodes cost no more queries."""
    from django.db import connection
    from django.db.models import F
    from django.test.utils import CaptureQueriesContext

    from fleet.devices import refresh_fingerprints
    from fleet.models import NodeResource
    from leases import placement
    from leases.services import resolve_shape
    from leases.spec import parse_spec

    pool = PoolFactory(name="gpu")
    for tag in ("h1", "h2"):
        make_gpu_node(pool, tag=tag, count=4)
    Device.objects.filter(index__gte=2).update(interconnect_group="nvlink-1")
    refresh_fingerprints()  # written past sync_counts
    make_gpu_node(pool, tag="a1", count=4, model=A100, memory=40 * 2**30)
    h100 = {"attribute": "model", "operator": "glob", "value": "*H100*"}
    _, status = grant(client_user, "two", devices=[{"type": "nvidia.com/gpu", "count": 2, "constraints": [h100]}])
    assert status == 201
    # Only the held devices stand in the way: the count says there is room (the allocation of the
    # held ones stays, as it does with every live hold; the 409 reads a node with any allocation on
    # its own devices, leases.sql.devices.device_reasons_sql).
    NodeResource.objects.filter(name="nvidia.com/gpu").update(allocatable=F("allocatable") + 2)
    three = {"type": "nvidia.com/gpu", "count": 3, "constraints": [h100], "colocate": "interconnect_group"}
    spec = resolve_shape(parse_spec({"workload_id": "w", "pool": "gpu", "devices": [three]}))[0]

    def explain():
        with CaptureQueriesContext(connection) as queries:
            answer = placement.diagnose(pool, spec)
        return answer, len(queries.captured_queries)

    answer, few = explain()
    assert answer["reasons"] == {"device_not_colocated": 1, "device_not_free": 1, "device_unmatched": 1}
    assert "1 node(s) had no free nvidia.com/gpu matching model=*H100*" in answer["message"]
    for tag in ("a2", "a3", "a4"):
        make_gpu_node(pool, tag=tag, count=4, model=A100, memory=40 * 2**30)
    answer, more = explain()
    assert answer["reasons"] == {"device_not_colocated": 1, "device_not_free": 1, "device_unmatched": 4}
    assert more == few


def test_a_count_request_reads_no_devices_to_place_and_its_claim_passes_over_a_node_without_them(client_user):
    """``nvidia.com/gpu: N`` alone is decided by the capacity filter: placement reads no device
    rows, and a node whose count says free while its devices are held (a racing grant's claim,
    not yet counted) is passed over by the grant's claim for the next candidate, never doubled."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from fleet.models import NodeResource
    from leases import placement
    from leases.services import resolve_shape
    from leases.spec import parse_spec

    pool = PoolFactory(name="gpu")
    first, _ = make_gpu_node(pool, tag="a", count=2)
    second, _ = make_gpu_node(pool, tag="b", count=2)
    taken, _ = grant(client_user, "held", resources={"nvidia.com/gpu": 2})
    held_node = taken.node_id
    NodeResource.objects.filter(node_id=held_node, name="nvidia.com/gpu").update(allocated=0)  # the count lags
    spec = resolve_shape(parse_spec({"workload_id": "w", "pool": "gpu", "resources": {"nvidia.com/gpu": 2}}))[0]
    with CaptureQueriesContext(connection) as queries:
        found = placement.find_candidates(pool, spec)
    assert {c.node.pk for c in found.candidates} == {first.pk, second.pk}
    assert not [q for q in queries.captured_queries if "fleet_device" in q["sql"]]
    lease, status = grant(client_user, "w", resources={"nvidia.com/gpu": 2})
    assert status == 201 and lease.node_id != held_node
    # Now only the node whose count lags is left: its claim refuses, and the 409 reads the devices.
    assert grant_status(client_user, "x", pool="gpu", resources={"nvidia.com/gpu": 2}) == 409
    assert LeaseDevice.objects.filter(live=True).values("device_id").distinct().count() == 4
    assert LeaseDevice.objects.filter(live=True).count() == 4


def test_a_gpu_request_walks_the_nodes_with_free_gpus_not_the_fullest_cpus(client_user):
    """The scarce resource drives the candidate walk (leases.placement_filter.primary_resource):
    driven by cpu, a binpack of 1-GPU leases kept the nodes whose GPUs it had filled at the head of
    the walk (each lease took little cpu) and every later grant read past them in SQL."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from fleet.choices import SchedulingPolicy
    from fleet.models import NodeResource
    from leases import placement
    from leases.placement_filter import primary_resource
    from leases.services import resolve_shape
    from leases.spec import parse_spec

    pool = PoolFactory(name="gpu", scheduling_policy=SchedulingPolicy.BINPACK)
    nodes = [make_gpu_node(pool, tag=tag, count=2)[0] for tag in ("a", "b", "c")]
    held, _ = grant(client_user, "held", resources={"nvidia.com/gpu": 2})
    NodeResource.objects.filter(node_id=held.node_id, name="cpu").update(allocated=63900)  # the fullest cpu
    body = {"workload_id": "w", "pool": "gpu", "resources": {"cpu": "100m", "nvidia.com/gpu": 1}}
    spec = resolve_shape(parse_spec(body))[0]
    assert primary_resource(spec) == "nvidia.com/gpu"
    with CaptureQueriesContext(connection) as queries:
        search = placement.find_candidates(pool, spec)
    assert {c.node.pk for c in search.candidates} == {n.pk for n in nodes} - {held.node_id}
    walk = next(q["sql"] for q in queries.captured_queries if "ORDER BY" in q["sql"] and "noderesource" in q["sql"])
    assert """"fleet_noderesource"."name" = 'nvidia.com/gpu'""" in walk


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the one-statement claim is PostgreSQL's")
def test_the_one_statement_claim_inserts_the_lease_with_its_devices(client_user):
    """On PostgreSQL a plain device request's claim INSERTs the lease row in the same statement
    (leases.sql.devices.claim_plain): no separate INSERT of the lease, and the stored row is the
    one an INSERT of the instance would have stored."""
    make_gpu_node(PoolFactory(name="gpu"), count=4)
    statements = []

    def record(execute, sql, params, many, context):
        statements.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        lease, status = grant(client_user, "a", resources={"nvidia.com/gpu": 2}, command=["train"])
    assert status == 201
    assert not [s for s in statements if s.lstrip().startswith('INSERT INTO "leases_lease"')]
    assert any("leased AS (INSERT INTO" in s for s in statements)
    stored = Lease.objects.get(pk=lease.pk)
    assert (
        stored.devices
        == lease.devices
        == [
            {"id": "GPU-n-0000", "type": "nvidia.com/gpu", "index": 0},
            {"id": "GPU-n-0001", "type": "nvidia.com/gpu", "index": 1},
        ]
    )
    for field in Lease._meta.concrete_fields:
        assert getattr(stored, field.attname) == getattr(lease, field.attname), field.name


def test_a_second_live_lease_of_the_workload_is_409_not_a_lost_race(client_user, client_api):
    """The workload's partial unique index refuses the second live lease inside the device claim's
    statement too (PostgreSQL): the answer is workload_has_live_lease, not a device race lost on
    every node, and nothing of the second is held."""
    make_gpu_node(PoolFactory(name="gpu"), count=4)
    first, status = grant(client_user, "a", resources={"nvidia.com/gpu": 1})
    assert status == 201
    body = {"workload_id": "a", "pool": "gpu", "resources": {"nvidia.com/gpu": 1}}
    inserts = []

    def record(execute, sql, params, many, context):
        if "INSERT INTO" in sql and "leases_lease " in sql.replace('"', "") + " ":
            inserts.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        response = client_api.post("/api/v1/node-leases", body, format="json")
    assert response.status_code == 409 and response.json()["code"] == "workload_has_live_lease", response.content
    assert len(inserts) == 1  # refused once, not retried as a race for the devices on every round
    assert LeaseDevice.objects.filter(live=True).count() == 1
    assert list(Device.objects.filter(claimed=True).values_list("device_id", flat=True)) == [first.devices[0]["id"]]
