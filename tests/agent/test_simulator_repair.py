"""The simulator honours a repair reboot instruction as an agent with ``--repair-reboot-command``
does: the host reboots once per repair (a new boot id and incarnation), and the reboot cures a
node that reported Ready=False unless told it does not."""

from __future__ import annotations

from simulator import PoolSpec
from simulator.node import VirtualNode
from simulator.shapes import generate


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
