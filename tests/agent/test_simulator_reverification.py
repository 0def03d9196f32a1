"""Issue 32, "Done when": a node that passed admission and is then swapped for weaker hardware (the
simulator answers benchmarks low) is deverified at its next scheduled check, work that requires
verification goes elsewhere, its owner reads why, and it returns after passing a later check."""

import time

import pytest
from django.contrib.auth.models import Group, User
from rest_framework.test import APIClient

from fleet.choices import ReverificationState
from fleet.events import Actor
from fleet.models import Node, NodeEvent, Reverification
from fleet.reverification import reverify_due
from fleet.trust import UNVERIFIED_TAINT_KEY
from leases.models import Lease
from nodepool.api.permissions import OWNERS
from simulator import FleetThread, PoolSpec
from tests.control_plane import ControlPlane
from tests.support import grant_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("no_flood_guard")]
SWEEP = Actor.system("test:fleet.reverify_due_nodes")
POOL = {"benchmark_required": True, "reverification_period": 3600, "reverification_window": 600,
        "reverification_tolerance_percent": 20}  # fmt: skip
PIN = {"kubernetes.io/hostname": "sim-1-0001"}
TOLERATE = {"key": UNVERIFIED_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}


def _check_now(fleet, node: Node) -> Reverification:
    """Bring the node's drawn check forward to now, run the sweep, and let the node answer."""
    Reverification.objects.filter(node=node, state=ReverificationState.SCHEDULED).update(due_at=node.created_at)
    assert reverify_due(actor=SWEEP)["started"] >= 1
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        fleet.beat_all()
        run = Reverification.objects.filter(node=node).exclude(state=ReverificationState.SCHEDULED).first()
        if run is not None and run.state in (ReverificationState.PASSED, ReverificationState.FAILED):
            return run
        time.sleep(0.05)
    raise AssertionError("the node did not finish its re-verification")


def test_a_swapped_node_is_deverified_avoided_told_and_returns_after_passing():
    cp = ControlPlane({"rack": POOL})
    owner = User.objects.create(username="olga")
    owner.groups.add(Group.objects.get_or_create(name=OWNERS)[0])
    sim = cp.make_simulator(pools=[PoolSpec("rack", cp.tokens["rack"])], renewals=False)
    with FleetThread(sim) as fleet:
        fleet.enroll(2)
        for name in ("sim-1-0000", "sim-1-0001"):
            cp.admit(sim.node(name).node_id)
        deadline = time.monotonic() + 15
        while Node.objects.exclude(lifecycle="ready").exists() and time.monotonic() < deadline:
            fleet.beat_all()
            time.sleep(0.05)
        honest, swapped = (cp.node_by_hostname(n) for n in ("sim-1-0000", "sim-1-0001"))
        assert honest.lifecycle == swapped.lifecycle == "ready"
        Node.objects.filter(pk=swapped.pk).update(owner=owner)
        # The first sweep draws each node's check within the window of the period.
        assert reverify_due(actor=SWEEP)["scheduled"] == 2
        for run in Reverification.objects.all():
            assert 3000 <= (run.due_at - run.created_at).total_seconds() <= 3601

        fleet.underperform("sim-1-0001", 0.5)  # the machine behind the node is now half of it
        failed = _check_now(fleet, swapped)
        assert _check_now(fleet, honest).state == ReverificationState.PASSED

        assert failed.state == ReverificationState.FAILED and failed.code == "measured_below_verified"
        assert failed.evidence["ratios"]["cpu"] < 0.8 and failed.mode == "full"
        swapped.refresh_from_db()
        assert {"key": UNVERIFIED_TAINT_KEY, "value": "", "effect": "NoSchedule"} in swapped.taints
        (condition,) = [c for c in swapped.conditions if c["type"] == "Unverified"]
        assert (condition["status"], condition["reason"]) == ("True", "MeasuredBelowVerified")
        event = NodeEvent.objects.filter(node=swapped, type="reverification", to_state="failed").get()
        assert event.data["code"] == "measured_below_verified" and event.data["measured"]["cpu"] > 0
        fleet.beat_all()  # the node's own report does not clear the server's condition
        swapped.refresh_from_db()
        assert [c["status"] for c in swapped.conditions if c["type"] == "Unverified"] == ["True"]

        # Work that requires verification (tolerates nothing) goes to the honest node only; pinned
        # to the swapped node it is not placed; work that tolerates the taint may still go there.
        leases = [cp.grant_lease(["serve"], pool="rack") for _ in range(4)]
        assert {lease.node_id for lease in leases} == {honest.pk}
        assert grant_status(cp.client_user(), "pinned", pool="rack", cpu="100m", node_selector=PIN) in (202, 409)
        tolerant = cp.grant_lease(["serve"], pool="rack", node_selector=PIN, tolerations=[TOLERATE])
        assert tolerant.node_id == swapped.pk

        owner_api = APIClient()
        owner_api.force_authenticate(owner)
        seen = owner_api.get(f"/api/v1/nodes/{swapped.pk}/verification").json()
        assert (seen["state"], seen["code"]) == ("unverified", "measured_below_verified")
        assert "measured cpu" in seen["reason"] and "hardware" in seen["next_steps"]
        assert "due_at" not in str(seen)

        fleet.underperform("sim-1-0001", 1.0)  # the original hardware is back
        assert _check_now(fleet, swapped).state == ReverificationState.PASSED
        swapped.refresh_from_db()
        assert not any(t["key"] == UNVERIFIED_TAINT_KEY for t in swapped.taints)
        assert [c["status"] for c in swapped.conditions if c["type"] == "Unverified"] == ["False"]
        assert owner_api.get(f"/api/v1/nodes/{swapped.pk}/verification").json()["state"] == "verified"
        assert cp.grant_lease(["serve"], pool="rack", node_selector=PIN).node_id == swapped.pk
        assert all(lease.state == "active" or lease.state == "granted" for lease in Lease.objects.all())
    cp.close()
