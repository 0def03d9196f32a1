"""A forward jump of the server clock expires nothing (issue 12, case 2).

Control-plane time stands still across a detected gap (fleet.clock): the very first heartbeat after
a jump longer than the credential lifetime is not refused (the web path does not wait for a sweep),
and once a sweep notices the jump, credentials, leases, drain deadlines, bootstrap tokens and holds
move later by it. Jumps both shorter and longer than every lifetime are tested.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection

from fleet import clock
from fleet import event_types as fleet_events
from fleet.credentials import issue_credential
from fleet.events import Actor
from fleet.liveness_sweep import sweep_liveness
from fleet.models import BootstrapToken, ControlPlaneClock, NodeCredential, NodeEvent
from leases.models import Lease
from leases.sweeps import expire_leases
from maintenance.drains import start_drain, sweep_drains
from maintenance.holds import place_hold
from maintenance.models import Drain
from tests.factories import make_schedulable_node
from tests.fleet_support import enroll, fresh_throttles, make_token  # noqa: F401
from tests.heartbeat_support import T0, post_beat, seconds
from tests.maintenance_support import make_lease
from tests.support import node_api

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fresh_throttles", "clock_at_t0")]

HOUR = 3600
# Lifetimes: credential 1 h, lease 30 min, drain deadline 20 min, bootstrap token 15 min, hold 10 min.
CREDENTIAL, LEASE, DRAIN, TOKEN, HOLD = HOUR, 1800, 1200, 900, 600


@pytest.fixture
def fleet(operator):
    """One node with a 1 h credential, a 30 min lease, a 20 min drain, a 10 min hold, a 15 min token."""
    node, _ = make_schedulable_node()
    NodeCredential.objects.filter(node=node).delete()
    _, secret = issue_credential(node=node, issuer="test", ttl_seconds=CREDENTIAL)
    lease = make_lease(node, "job-1", ttl=LEASE)
    drained, _ = make_schedulable_node(node.pool)
    make_lease(drained, "job-2", ttl=LEASE)
    drain = start_drain(
        node_id=drained.pk, expected_version=drained.version, policy="wait", deadline=T0 + seconds(DRAIN),
        reason="rack", actor=Actor("user", operator.username, user=operator),
    )  # fmt: skip
    hold = place_hold(node, "system:health-check", "flapping", T0 + seconds(HOLD))
    token = make_token(node.pool, ttl=TOKEN)
    sweep_liveness()  # the control plane is running: its clock is observed at T0
    return {"node": node, "secret": secret, "lease": lease, "drain": drain, "hold": hold, "token": token}


def jump(time_machine, by: float):
    time_machine.move_to(T0 + seconds(by), tick=False)


def sweep_everything():
    sweep_liveness()
    expire_leases()
    sweep_drains(actor=Actor.system("test"))


def keep_observing(time_machine, *, start: float, until: float, every: float = 30):
    """The control plane running normally from T0 + start to T0 + until: observed every ``every`` s."""
    t = start
    while t <= until:
        time_machine.move_to(T0 + seconds(t), tick=False)
        clock.observe()
        t += every


def test_the_very_first_heartbeat_after_a_jump_longer_than_the_credential_is_not_refused(time_machine, fleet):
    jump(time_machine, 3 * HOUR)

    response = post_beat(node_api(fleet["secret"]), fleet["node"], sequence=1)

    assert response.status_code == 200, response.json()
    assert response.json()["applied"] is True


def test_a_lease_renewed_right_after_a_jump_before_any_sweep_is_not_expired(time_machine, fleet, operator_api):
    lease = fleet["lease"]
    jump(time_machine, 3 * HOUR)

    response = operator_api.post(
        f"/api/v1/node-leases/{lease.pk}/renew",
        {"fencing_token": lease.fencing_token, "node_incarnation": lease.node_incarnation},
        format="json",
    )

    assert response.status_code == 200, response.json()
    lease.refresh_from_db()
    assert lease.expires_at == T0 + seconds(3 * HOUR + LEASE)


def test_enrollment_right_after_a_jump_longer_than_the_token_lifetime_is_accepted(time_machine, fleet, anon_api):
    jump(time_machine, 3 * HOUR)

    response = enroll(anon_api, fleet["token"])

    assert response.status_code == 201, response.json()


@pytest.mark.parametrize("by", [10 * 60, 3 * HOUR], ids=["shorter-than-every-lifetime", "longer-than-every-lifetime"])
def test_after_a_jump_every_lifetime_counts_from_where_it_stood(time_machine, fleet, anon_api, by):
    paused = seconds(by - 5)  # the gap minus one sweep interval the control plane expected anyway
    before = {
        "credential": NodeCredential.objects.get(node=fleet["node"]).expires_at,
        "lease": fleet["lease"].expires_at,
        "drain": fleet["drain"].deadline,
        "token": BootstrapToken.objects.get().expires_at,
        "hold": fleet["hold"].expires_at,
    }
    jump(time_machine, by)

    sweep_everything()

    after = {
        "credential": NodeCredential.objects.get(node=fleet["node"]).expires_at,
        "lease": Lease.objects.get(pk=fleet["lease"].pk).expires_at,
        "drain": Drain.objects.get(pk=fleet["drain"].pk).deadline,
        "token": BootstrapToken.objects.get().expires_at,
        "hold": fleet["node"].holds.get().expires_at,
    }
    assert after == {name: value + paused for name, value in before.items()}
    assert Lease.objects.get(pk=fleet["lease"].pk).state == "active"
    assert Drain.objects.get(pk=fleet["drain"].pk).state == "active"
    assert fleet["node"].holds.get().removed_at is None
    assert post_beat(node_api(fleet["secret"]), fleet["node"], sequence=1).status_code == 200
    assert enroll(anon_api, fleet["token"]).status_code == 201
    event = NodeEvent.objects.get(type=fleet_events.CLOCK_JUMP)
    assert (event.node_id, event.data["paused_seconds"]) == (None, paused.total_seconds())
    assert event.data["shifted"]["credentials"] >= 1 and event.data["shifted"]["leases"] == 2

    # Time runs on from there: the lease expires one remaining lifetime after the jump, not before.
    keep_observing(time_machine, start=by, until=by + LEASE - 5 - 1)
    jump(time_machine, by + LEASE - 5 - 1)
    expire_leases()
    assert Lease.objects.get(pk=fleet["lease"].pk).state == "active"
    jump(time_machine, by + LEASE - 5)
    expire_leases()
    assert Lease.objects.get(pk=fleet["lease"].pk).state == "expired"


def test_a_superseded_credential_gets_no_grace(time_machine, fleet):
    old = fleet["secret"]
    rotated = node_api(old).post(f"/api/v1/nodes/{fleet['node'].pk}/credentials/rotate", {}, format="json")
    assert rotated.status_code in (200, 201), rotated.json()
    superseded = NodeCredential.objects.get(node=fleet["node"], rotated_at__isnull=False)
    jump(time_machine, 3 * HOUR)

    before_sweep = post_beat(node_api(old), fleet["node"], sequence=1)
    sweep_everything()

    assert before_sweep.status_code == 401
    assert "replaced by a rotation" in before_sweep.json()["detail"]
    superseded.refresh_from_db()
    assert superseded.expires_at <= T0 + seconds(3 * HOUR)  # never shifted by the jump


def test_a_backward_jump_pauses_nothing(time_machine, fleet):
    expires = NodeCredential.objects.get(node=fleet["node"]).expires_at
    jump(time_machine, -HOUR)

    sweep_everything()

    assert NodeCredential.objects.get(node=fleet["node"]).expires_at == expires
    assert not NodeEvent.objects.filter(type=fleet_events.CLOCK_JUMP).exists()


def test_an_ordinary_sweep_interval_is_not_a_jump(time_machine, fleet):
    expires = fleet["lease"].expires_at
    for step in range(1, 13):
        jump(time_machine, 5 * step)
        sweep_everything()

    assert Lease.objects.get(pk=fleet["lease"].pk).expires_at == expires
    assert ControlPlaneClock.objects.get().paused_seconds == 0


@pytest.mark.django_db(transaction=True)
def test_two_sweeps_noticing_the_same_jump_at_once_pause_it_once(time_machine):
    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-1", ttl=LEASE)
    clock.observe(now=T0)
    barrier = threading.Barrier(2)
    gaps, errors = [], []

    def run():
        try:
            barrier.wait()
            gaps.append(clock.observe(now=T0 + timedelta(hours=3)))
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert sum(1 for gap in gaps if gap is not None) == 1
    lease.refresh_from_db()
    assert lease.expires_at == T0 + seconds(LEASE) + seconds(3 * HOUR - 5)
    assert NodeEvent.objects.filter(type=fleet_events.CLOCK_JUMP).count() == 1
