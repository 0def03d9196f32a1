"""The simulator honours a repair reboot instruction as an agent with ``--repair-reboot-command``
does: the host reboots once per repair (a new boot id and incarnation), and the reboot cures a
node that reported Ready=False unless told it does not."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.events import Actor
from fleet.models import NodeEvent
from operations import outofservice, repair
from operations.choices import RepairState
from operations.models import PoolOperations, Repair
from simulator import FleetThread, PoolSpec
from simulator.node import VirtualNode
from simulator.shapes import generate
from tests.control_plane import ControlPlane


def node() -> VirtualNode:
    return VirtualNode(generate(1, seed=1, pools=[PoolSpec("general", "t")], zones=["a"])[0])


def ready_condition(body: dict) -> str:
    return next(c["status"] for c in body["conditions"] if c["type"] == "Ready")


def test_a_repair_reboot_gives_a_new_boot_and_cures_not_ready_once_per_repair():
    vm = node()
    vm.not_ready = True
    body = vm.heartbeat_body()
    assert (body["ready"], ready_condition(body)) == (False, "False")
    boot, incarnation = vm.boot_id, vm.incarnation
    assert vm.repair({"repair_id": "r-1", "action": "reboot"}) is True
    after = vm.heartbeat_body()
    assert (after["ready"], ready_condition(after)) == (True, "True")
    assert after["boot_id"] != boot and vm.incarnation == incarnation + 1
    assert vm.repair({"repair_id": "r-1", "action": "reboot"}) is False  # once per repair
    assert vm.repair({"repair_id": "r-2", "action": "reimage"}) is False  # only reboots
    assert vm.counters["repair_reboots"] == 1


def test_a_reboot_that_does_not_cure_keeps_the_node_failing():
    vm = node()
    vm.not_ready, vm.reboot_cures = True, False
    vm.repair({"repair_id": "r-1", "action": "reboot"})
    assert ready_condition(vm.heartbeat_body()) == "False"


@pytest.mark.django_db(transaction=True)
def test_a_simulated_fleet_reboots_the_node_a_repair_drained_and_it_returns_when_healthy():
    cp = ControlPlane(heartbeat_interval=10)
    sim = cp.make_simulator(renewals=False)
    actor = Actor.system(outofservice.REPAIR)
    try:
        with FleetThread(sim) as fleet:
            names = fleet.enroll(3)
            fleet.beat_all()
            for name in names:
                cp.admit(cp.node_by_hostname(name).pk)
            node = cp.node_by_hostname(names[0])
            PoolOperations.objects.update_or_create(
                pool=node.pool,
                defaults={"repair_rules": [{"condition": "Ready", "status": "False", "for": 10, "action": "reboot"}],
                          "repair_max_unhealthy": 0.5},
            )  # fmt: skip
            fleet.not_ready(names[0])
            fleet.beat_all()
            boot = fleet.node(names[0])["boot_id"]
            start = timezone.now()
            for seconds in (20, 30):  # due: drained (no leases: at once), then told to reboot
                repair.sweep(now=start + timedelta(seconds=seconds), actor=actor)
            assert Repair.objects.get().state == RepairState.REBOOTING
            fleet.beat_all()  # the status report's answer carries the instruction: the host reboots
            fleet.beat_all()  # the new incarnation reports, Ready=True
            for seconds in (40, 50):
                repair.sweep(now=start + timedelta(seconds=seconds), actor=actor)
            after = fleet.node(names[0])
    finally:
        cp.close()
    done = Repair.objects.get()
    assert done.state == RepairState.SUCCEEDED, done.detail
    assert after["boot_id"] != boot
    assert sim.node(names[0]).counters["repair_reboots"] == 1
    planned = NodeEvent.objects.filter(type="repair", node=node, data__planned_reboot=True)
    assert planned.count() == 1
    node = cp.node_by_hostname(names[0])
    assert (node.lifecycle, node.cordoned) == ("ready", False)
