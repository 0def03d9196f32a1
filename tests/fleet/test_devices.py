"""Devices as rows: inventory from reports, verification, identity across the fleet, health."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet import devices as fleet_devices
from fleet.events import Actor
from fleet.models import Device, Node, NodeEvent, NodeResource
from tests.device_support import gpu, gpus, make_gpu_node, report_devices
from tests.factories import make_schedulable_node, set_lifecycle
from tests.heartbeat_support import beat
from tests.support import node_api

pytestmark = pytest.mark.django_db


def gpu_count(node) -> int:
    row = NodeResource.objects.filter(node=node, name="nvidia.com/gpu").first()
    return row.allocatable if row else 0


def test_a_status_report_stores_each_device_as_a_row_unverified_after_admission(no_flood_guard):
    node, secret = make_schedulable_node()
    response = node_api(secret).post(
        f"/api/v1/nodes/{node.pk}/heartbeats", beat(devices=gpus(2), boot_id="boot-1"), format="json"
    )
    assert response.status_code == 200, response.content
    rows = list(Device.objects.filter(node=node).order_by("index"))
    assert [r.device_id for r in rows] == ["GPU-n-0000", "GPU-n-0001"]
    assert rows[0].model == "NVIDIA H100 80GB HBM3" and rows[0].memory_bytes == 80 * 2**30
    assert rows[0].verified_at is None and not rows[0].allocatable
    assert gpu_count(node) == 0  # appeared after admission: not allocatable until verified
    assert Node.objects.get(pk=node.pk).boot_id == "boot-1"


def test_an_operator_verifies_a_device_and_it_becomes_allocatable(operator_api):
    node, _ = make_gpu_node(count=2, verified=False)
    etag = operator_api.get(f"/api/v1/nodes/{node.pk}")["ETag"]
    response = operator_api.post(
        f"/api/v1/nodes/{node.pk}/devices/GPU-n-0001/verify", {"reason": "seen on site"}, format="json",
        HTTP_IF_MATCH=etag,
    )  # fmt: skip
    assert response.status_code == 200, response.content
    assert response.json()["allocatable"] is True
    assert gpu_count(node) == 1
    assert operator_api.get(f"/api/v1/nodes/{node.pk}/devices").json()[1]["verified_by"] == "olivia-operator"


def test_a_device_action_without_the_expected_version_is_refused(operator_api):
    node, _ = make_gpu_node(count=1, verified=False)
    response = operator_api.post(f"/api/v1/nodes/{node.pk}/devices/GPU-n-0000/verify", {}, format="json")
    assert response.status_code == 428
    assert Device.objects.get(device_id="GPU-n-0000").verified_at is None


def test_admission_verifies_the_devices_present_and_counts_them():
    from fleet.admission import finalize_admission
    from fleet.models import AdmissionCheck

    node, _ = make_schedulable_node()
    report_devices(node, gpus(4))
    set_lifecycle(node, "admitting")
    Node.objects.filter(pk=node.pk).update(admission_attempt=1)
    AdmissionCheck.objects.create(node=node, attempt=1, name="capabilities", status="passed")
    assert finalize_admission(node_id=node.pk, attempt=1, actor=Actor.system("test")) == "ready"
    assert Device.objects.filter(node=node, verified_at__isnull=False).count() == 4
    assert gpu_count(node) == 4


def test_a_bad_device_never_spoils_the_rest_of_the_report(no_flood_guard):
    node, secret = make_schedulable_node()
    devices = [gpu(0), {"id": "GPU-bad", "type": "nvidia.com/gpu", "index": 1, "memory_bytes": 2**60}, "junk",
               gpu(2), gpu(2)]  # fmt: skip
    response = node_api(secret).post(
        f"/api/v1/nodes/{node.pk}/heartbeats", beat(devices=devices, ready=True), format="json"
    )
    assert response.status_code == 200
    assert list(Device.objects.filter(node=node).values_list("device_id", flat=True)) == ["GPU-n-0000"]
    refused = NodeEvent.objects.get(node=node, type="device", to_state="refused").data["refused"]
    assert {r["reason"].split(":")[0] for r in refused} >= {"memory_bytes", "a device is an object"}
    assert any(r["reason"] == "duplicate id within the report" for r in refused)
    assert Node.objects.get(pk=node.pk).ready is True


def test_more_than_the_bound_refuses_the_device_part_only():
    parsed, refusals = fleet_devices.parse_devices([gpu(i % 1000) for i in range(257)])
    assert parsed is None and "more than 256" in refusals[0]["reason"]


def test_the_same_gpu_on_a_second_live_node_quarantines_the_later_claimant_only():
    first, _ = make_gpu_node(count=2, tag="a")
    second, _ = make_schedulable_node(first.pool)
    result = report_devices(second, [gpu(0, node="a")])
    assert result["conflicts"][0]["held_by"] == str(first.pk)
    assert Node.objects.get(pk=second.pk).lifecycle == "quarantined"
    assert Node.objects.get(pk=first.pk).lifecycle == "ready"
    assert Device.objects.get(device_id="GPU-a-0000", retired_at__isnull=True).node_id == first.pk


def test_a_retired_nodes_device_is_handed_over_not_a_conflict():
    first, _ = make_gpu_node(count=1, tag="a")
    set_lifecycle(first, "retired")
    second, _ = make_schedulable_node(first.pool)
    result = report_devices(second, [gpu(0, node="a")])
    assert result["conflicts"] == []
    assert Device.objects.get(device_id="GPU-a-0000", retired_at__isnull=True).node_id == second.pk
    assert Device.objects.get(device_id="GPU-a-0000", node=first).retired_reason.startswith("handed over")
    assert Node.objects.get(pk=second.pk).lifecycle == "ready"


def test_a_replaced_gpu_is_a_new_device_and_the_old_one_is_retired_with_its_history():
    node, _ = make_gpu_node(count=2)
    report_devices(node, [gpu(0), {**gpu(1), "id": "GPU-new"}])
    old = Device.objects.get(device_id="GPU-n-0001")
    assert old.retired_reason == "replaced by GPU-new"
    assert Device.objects.get(device_id="GPU-new").verified_at is None
    assert gpu_count(node) == 1


def test_a_fatal_xid_taints_one_gpu_noexecute_and_the_node_stays_healthy():
    node, _ = make_gpu_node(count=2)
    health = {"xid_events": [{"xid": 79, "at": "2026-12-02T10:00:00Z", "message": "fell off the bus"}]}
    result = report_devices(node, [gpu(0, health=health), gpu(1)])
    bad = Device.objects.get(device_id="GPU-n-0000")
    assert bad.health == "unhealthy" and bad.taints[0]["effect"] == "NoExecute"
    assert result["faulted"] == [bad.pk]
    assert gpu_count(node) == 1
    assert Node.objects.get(pk=node.pk).health == "healthy"


def test_a_warning_level_xid_is_recorded_and_taints_nothing():
    node, _ = make_gpu_node(count=1)
    report_devices(node, [gpu(0, health={"xid_events": [{"xid": 94, "at": "t"}]})])
    row = Device.objects.get(device_id="GPU-n-0000")
    assert row.taints == [] and row.allocatable
    assert row.health_detail["recent_xids"][0]["resolution"] == "info"
    assert NodeEvent.objects.filter(node=node, type="device", to_state="recorded").exists()


def test_a_reset_needing_fault_lifts_after_a_reboot_and_a_quiet_period_lifts_it_too():
    node, _ = make_gpu_node(count=2)
    report_devices(node, [gpu(0, health={"ecc_uncorrectable": 3}), gpu(1)], boot_id="boot-1")
    assert Device.objects.get(device_id="GPU-n-0000").taints[0]["effect"] == "NoSchedule"
    report_devices(node, [gpu(0, health={"ecc_uncorrectable": 0}), gpu(1)], boot_id="boot-2")
    assert Device.objects.get(device_id="GPU-n-0000").allocatable
    later = timezone.now() + timedelta(hours=2)
    report_devices(node, [gpu(0), gpu(1, health={"remapped_rows_failure": True})], boot_id="boot-2")
    assert fleet_devices.recover_devices(now=later) == 1
    assert gpu_count(node) == 2


def test_a_flapping_device_is_held_until_an_operator_releases_it(operator_api):
    node, _ = make_gpu_node(count=1)
    for boot in range(3):
        report_devices(node, [gpu(0, health={"xid_events": [{"xid": 79, "at": "t"}]})], boot_id=f"b{boot}")
    row = Device.objects.get(device_id="GPU-n-0000")
    assert row.held
    report_devices(node, [gpu(0)], boot_id="b9")
    assert not Device.objects.get(device_id="GPU-n-0000").allocatable
    etag = operator_api.get(f"/api/v1/nodes/{node.pk}")["ETag"]
    response = operator_api.post(
        f"/api/v1/nodes/{node.pk}/devices/GPU-n-0000/release", {"reason": "reseated"}, format="json",
        HTTP_IF_MATCH=etag,
    )  # fmt: skip
    assert response.status_code == 200
    report_devices(node, [gpu(0)], boot_id="b10")
    assert Device.objects.get(device_id="GPU-n-0000").allocatable


def test_an_operator_taints_and_untaints_one_device_with_a_reason(operator_api):
    node, _ = make_gpu_node(count=2)
    etag = operator_api.get(f"/api/v1/nodes/{node.pk}")["ETag"]
    url = f"/api/v1/nodes/{node.pk}/devices/GPU-n-0001"
    response = operator_api.post(
        f"{url}/taint", {"key": "ops/suspect", "effect": "NoSchedule", "reason": "fan noise"}, format="json",
        HTTP_IF_MATCH=etag,
    )  # fmt: skip
    assert response.status_code == 200, response.content
    assert gpu_count(node) == 1
    etag = operator_api.get(f"/api/v1/nodes/{node.pk}")["ETag"]
    response = operator_api.post(f"{url}/untaint", {"key": "ops/suspect"}, format="json", HTTP_IF_MATCH=etag)
    assert response.status_code == 200
    assert gpu_count(node) == 2


def test_an_unchanged_inventory_costs_no_statement(django_assert_num_queries):
    node, _ = make_gpu_node(count=8)
    fresh = Node.objects.select_related("pool").get(pk=node.pk)
    parsed, _ = fleet_devices.parse_devices(gpus(8))
    with django_assert_num_queries(0):
        fleet_devices.apply_report(node=fresh, devices=parsed, refusals=[], boot_id=fresh.boot_id,
                                   actor=Actor.for_node(fresh))  # fmt: skip


def test_metrics_count_devices_by_type_normalised_model_and_health(operator_api):
    from fleet.devices import normalise_model

    node, _ = make_gpu_node(count=2)
    report_devices(node, [gpu(0, health={"xid_events": [{"xid": 79, "at": "t"}]}), gpu(1, model="Mystery GPU 9000")])
    from fleet.devices import device_metric_rows

    rows = {(t, m, h, a): n for _, t, m, h, a, n in device_metric_rows()}
    # the second GPU's model changed since it was verified: healthy, but not allocatable until verified again
    assert rows == {("nvidia.com/gpu", "H100", "unhealthy", False): 1, ("nvidia.com/gpu", "other", "healthy", False): 1}
    assert normalise_model("NVIDIA A100-SXM4-40GB") == "A100" and normalise_model("NVIDIA L40S") == "L40S"


def test_the_admin_node_page_lists_devices_and_the_device_admin_verifies(admin_client):
    from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME

    node, _ = make_gpu_node(count=2, verified=False)
    page = admin_client.get(f"/admin/fleet/node/{node.pk}/change/")
    assert page.status_code == 200 and b"GPU-n-0001" in page.content
    row = Device.objects.get(device_id="GPU-n-0001")
    response = admin_client.post("/admin/fleet/device/", {"action": "verify_devices", ACTION_CHECKBOX_NAME: [row.pk]})
    assert response.status_code == 302
    assert Device.objects.get(pk=row.pk).allocatable and gpu_count(node) == 1


def test_more_devices_than_verified_fall_under_capacity_above_verified():
    from maintenance.models import Quarantine

    node, _ = make_gpu_node(count=8)
    report_devices(node, gpus(9))  # one more than verified: unverified, not allocatable, no quarantine
    assert not Quarantine.objects.filter(node=node).exists()
    assert NodeResource.objects.get(node=node, name="nvidia.com/gpu").allocatable == 8
    report_devices(node, gpus(13))  # 13 > 1.5 × 8
    quarantine = Quarantine.objects.get(node=node)
    assert quarantine.rule == "capacity_above_verified"
    assert quarantine.evidence["over"] == {"nvidia.com/gpu": {"declared": 13, "verified": 8}}
    assert Node.objects.get(pk=node.pk).lifecycle == "quarantined"


def test_the_node_list_shows_free_devices_by_model_in_the_api_and_the_admin(admin_client, operator_api, client_user):
    from tests.factories import PoolFactory
    from tests.support import grant

    pool = PoolFactory(name="gpu")
    node, _ = make_gpu_node(pool, count=8)
    Device.objects.filter(node=node, index__gte=6).update(model="NVIDIA A100-SXM4-40GB")
    grant(client_user, "three", pool="gpu", resources={"nvidia.com/gpu": 3})
    make_gpu_node(pool, tag="b", count=1, model="Mystery GPU 9000")
    listed = {n["id"]: n for n in operator_api.get("/api/v1/nodes").json()["results"]}
    assert listed[str(node.pk)]["devices"]["nvidia.com/gpu"]["free_models"] == {"H100": 3, "A100": 2}
    page = admin_client.get("/admin/fleet/node/")
    assert page.status_code == 200
    assert "3×H100 2×A100".encode() in page.content and "1×Mystery GPU 9000".encode() in page.content
