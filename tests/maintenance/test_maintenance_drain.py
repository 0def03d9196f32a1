"""Drains: policies, progress, completion only after the node stops reporting, deadlines, cancel."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from fleet import event_types as fleet_events
from fleet.events import Actor
from fleet.models import NodeEvent
from leases import event_types as leases_events
from leases import fencing
from leases import reconcile as lease_reconcile
from leases.models import Lease
from maintenance import drains, tasks
from maintenance import event_types as maintenance_events
from maintenance.models import Drain, Eviction
from nodepool.api.versioning import etag_for
from tests.factories import make_schedulable_node
from tests.maintenance_support import act, allocated, heartbeat, make_lease, run_for
from tests.races import race

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
SYSTEM = Actor.system("test")


@pytest.fixture
def clock():
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


@pytest.fixture
def node(clock):
    node, _ = make_schedulable_node()
    return node


def start(api, node, policy="wait", deadline_in=3600, **extra):
    response = act(api, node, "drain", {"reason": "rack move", "policy": policy, "deadline_in": deadline_in, **extra})
    assert response.status_code == 201, response.json()
    return Drain.objects.get(pk=response.json()["id"])


def evaluate(drain: Drain) -> Drain:
    return drains.evaluate_drain(drain_id=drain.pk, actor=SYSTEM)


def end_lease(lease: Lease) -> None:
    lease_reconcile.revoke_lease(lease, actor=SYSTEM, reason="finished")


def test_a_drain_of_a_node_without_leases_completes_at_once_into_maintenance(operator_api, node):
    response = act(operator_api, node, "drain", {"reason": "rack move", "deadline_in": 600})

    assert response.status_code == 201
    body = response.json()
    assert response["Location"] == f"/api/v1/drains/{body['id']}"
    assert body["state"] == "completed"
    assert body["node"]["lifecycle"] == "maintenance"
    node.refresh_from_db()
    assert node.lifecycle == "maintenance"
    transitions = list(
        NodeEvent.objects.filter(node=node, type=fleet_events.LIFECYCLE)
        .order_by("id")
        .values_list("from_state", "to_state")
    )
    assert transitions == [("ready", "draining"), ("draining", "maintenance")]


def test_a_wait_drain_shows_leases_remaining_those_at_risk_and_what_it_waits_on(operator_api, node):
    short = make_lease(node, "job-short", ttl=60)
    long = make_lease(node, "job-long", ttl=7200)

    drain = start(operator_api, node, deadline_in=3600)

    assert drain.state == "active"
    assert drain.leases_at_start == 2
    assert drain.leases_remaining == 2
    assert drain.progress["at_risk"] == [str(long.pk)]
    assert [item["code"] for item in drain.progress["waiting_on"]] == ["leases_running"]
    assert set(drain.progress["waiting_on"][0]["lease_ids"]) == {str(short.pk), str(long.pk)}
    node.refresh_from_db()
    assert node.lifecycle == "draining"
    short.refresh_from_db()
    assert short.state == "active"  # the wait policy disrupts nothing


def test_a_drain_completes_only_after_the_node_stops_reporting_its_ended_leases(operator_api, node, clock):
    lease = make_lease(node, "job-1")
    heartbeat(node, lease)
    drain = start(operator_api, node)

    clock.shift(5)
    end_lease(lease)
    assert evaluate(drain).progress["waiting_on"][0]["code"] == "no_heartbeat_since_end"

    clock.shift(5)
    heartbeat(node, lease)  # the node still runs it
    drain = evaluate(drain)
    assert drain.state == "active"
    assert [item["code"] for item in drain.progress["waiting_on"]] == ["node_still_reporting"]
    node.refresh_from_db()
    assert node.lifecycle == "draining"

    clock.shift(5)
    heartbeat(node)  # the node no longer lists it
    drain = evaluate(drain)

    assert drain.state == "completed"
    node.refresh_from_db()
    assert node.lifecycle == "maintenance"  # never ready by itself


def test_a_terminate_drain_revokes_at_once_and_frees_capacity(operator_api, node, clock):
    leases = [make_lease(node, f"job-{i}") for i in range(3)]
    assert allocated(node) == 3000

    drain = start(operator_api, node, policy="terminate")

    assert {lease.state for lease in Lease.objects.filter(pk__in=[le.pk for le in leases])} == {"revoked"}
    assert allocated(node) == 0
    assert Eviction.objects.filter(drain=drain, kind="terminate").count() == 3
    assert drain.state == "active"  # until a heartbeat confirms the node stopped them
    clock.shift(10)
    heartbeat(node)
    assert evaluate(drain).state == "completed"


def test_a_checkpoint_drain_asks_for_a_checkpoint_and_ends_the_lease_once_checkpointed(operator_api, node, clock):
    lease = make_lease(node, "job-1")

    drain = start(operator_api, node, policy="checkpoint")

    lease.refresh_from_db()
    assert lease.checkpoint_requested_at == T0
    assert lease.state == "active"
    assert [item["code"] for item in drain.progress["waiting_on"]] == ["checkpoint_pending"]

    clock.shift(30)
    report_checkpointed(node, lease)
    heartbeat(node)
    drain = evaluate(drain)
    lease.refresh_from_db()
    assert lease.state == "revoked"
    assert drain.state == "active"  # ended after the last heartbeat: not yet confirmed

    clock.shift(10)
    heartbeat(node)
    assert evaluate(drain).state == "completed"


def report_checkpointed(node, lease: Lease) -> None:
    """The node reports ``checkpointed`` for ``lease`` (POST /node-leases/{id}/events)."""
    node.refresh_from_db()
    fencing.lease_report_event(
        lease_id=lease.pk,
        data={
            "fencing_token": lease.fencing_token,
            "node_incarnation": lease.node_incarnation,
            "state": "checkpointed",
        },
        node=node,
        actor=Actor.for_node(node),
    )


def test_a_checkpoint_taken_before_the_drain_asked_does_not_end_the_lease(operator_api, node, clock):
    lease = make_lease(node, "job-1")
    fencing.request_checkpoint(lease=lease, actor=Actor.system("test:client"))  # an earlier ask, answered
    report_checkpointed(node, lease)
    clock.shift(60)

    drain = start(operator_api, node, policy="checkpoint")
    clock.shift(5)
    heartbeat(node)
    drain = evaluate(drain)

    lease.refresh_from_db()
    assert lease.state == "active", "the work done since the old checkpoint would be lost"
    assert [item["code"] for item in drain.progress["waiting_on"]] == ["checkpoint_pending"]
    clock.shift(5)
    report_checkpointed(node, lease)  # the answer to this drain
    heartbeat(node)
    evaluate(drain)
    lease.refresh_from_db()
    assert lease.state == "revoked"


def system_checkpoint_drain(node, now=None) -> Drain:
    """A checkpoint drain as the workflows start it (not through the API), by ``now``."""
    node.refresh_from_db()
    return drains.start_drain(
        node_id=node.pk,
        expected_version=node.version,
        policy="checkpoint",
        deadline=T0 + timedelta(seconds=600),
        reason="rack move",
        actor=SYSTEM,
        now=now,
    )


def test_a_checkpoint_reported_while_the_drain_asks_answers_it(node, clock, monkeypatch):
    """The node's ``checkpointed`` event read its clock before the drain committed and landed
    after: it consumed the drain's request, so it is the drain's answer (nothing would ask again)."""
    lease = make_lease(node, "job-1")
    real_check, started = fencing.check_fence, []

    def drain_commits_meanwhile(*args, **kwargs):
        real_check(*args, **kwargs)
        if not started:
            clock.shift(1)
            started.append(system_checkpoint_drain(node))

    monkeypatch.setattr(fencing, "check_fence", drain_commits_meanwhile)
    report_checkpointed(node, lease)
    monkeypatch.setattr(fencing, "check_fence", real_check)

    clock.shift(5)
    heartbeat(node)
    evaluate(started[0])
    lease.refresh_from_db()
    assert lease.state == "revoked", "ended on the answer, not left for the deadline"


def test_a_checkpoint_counts_whatever_the_evaluating_clock_says(node, clock):
    """The drain's evaluations run in workers whose clocks may be ahead of the web server's that
    records the answer: no timestamps are compared."""
    lease = make_lease(node, "job-1")
    drain = system_checkpoint_drain(node, now=T0 + timedelta(seconds=2))  # a worker 2 s ahead
    clock.shift(1)
    report_checkpointed(node, lease)  # the web server's clock: T0 + 1
    heartbeat(node)
    drains.evaluate_drain(drain_id=drain.pk, actor=SYSTEM, now=T0 + timedelta(seconds=3))
    lease.refresh_from_db()
    assert lease.state == "revoked"


def test_the_deadline_fired_twice_enforces_exactly_once(operator_api, node, clock):
    leases = [make_lease(node, f"job-{i}", ttl=7200) for i in range(2)]
    drain = start(operator_api, node, deadline_in=600)

    clock.shift(601)
    tasks.enforce_drain_deadline(str(drain.pk))
    tasks.enforce_drain_deadline(str(drain.pk))

    drain.refresh_from_db()
    assert drain.state == "forced"
    assert drain.version == 2
    assert Eviction.objects.filter(drain=drain, kind="deadline").count() == 2
    assert {le.state for le in Lease.objects.filter(pk__in=[le.pk for le in leases])} == {"revoked"}
    assert NodeEvent.objects.filter(node=node, type=maintenance_events.DRAIN, to_state="forced").count() == 1
    assert NodeEvent.objects.filter(node=node, type=leases_events.LEASE, to_state="revoked").count() == 2
    node.refresh_from_db()
    assert node.lifecycle == "maintenance"
    assert allocated(node) == 0


def test_the_deadline_task_firing_early_changes_nothing(operator_api, node, clock):
    lease = make_lease(node, "job-1")
    drain = start(operator_api, node, deadline_in=600)

    clock.shift(300)
    tasks.enforce_drain_deadline(str(drain.pk))

    drain.refresh_from_db()
    lease.refresh_from_db()
    assert (drain.state, lease.state) == ("active", "active")


def test_the_deadline_task_firing_late_still_forces_the_drain(operator_api, node, clock):
    make_lease(node, "job-1")
    drain = start(operator_api, node, deadline_in=600)

    clock.shift(6 * 3600)
    tasks.enforce_drain_deadline(str(drain.pk))

    drain.refresh_from_db()
    assert drain.state == "forced"
    assert drain.finished_at == T0 + timedelta(hours=6)


def test_a_lost_deadline_task_is_covered_by_the_sweep(operator_api, node, clock):
    make_lease(node, "job-1")
    drain = start(operator_api, node, deadline_in=600)

    clock.shift(599)
    assert tasks.sweep_drains()["forced"] == 0
    clock.shift(2)
    counts = tasks.sweep_drains()
    again = tasks.sweep_drains()

    assert counts["forced"] == 1
    assert again["evaluated"] == 0
    drain.refresh_from_db()
    assert drain.state == "forced"


def test_a_deadline_task_for_a_missing_drain_is_harmless(db):
    assert tasks.enforce_drain_deadline("00000000-0000-0000-0000-000000000000") == "missing"


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_the_deadline_fired_concurrently_by_task_and_sweep_enforces_exactly_once(operator_api):
    node, _ = make_schedulable_node()
    for i in range(3):
        make_lease(node, f"job-{i}", ttl=7200)
    with time_machine.travel(datetime.now(UTC), tick=False) as clock:
        drain = start(operator_api, node, deadline_in=60)
        run_for(clock, 61)
        calls = [lambda: tasks.enforce_drain_deadline(str(drain.pk)), tasks.sweep_drains] * 2
        outcome = race(lambda index: calls[index](), len(calls))

    assert outcome.errors == []
    drain.refresh_from_db()
    assert drain.state == "forced"
    assert Eviction.objects.filter(drain=drain).count() == 3
    assert NodeEvent.objects.filter(node=node, type=maintenance_events.DRAIN, to_state="forced").count() == 1
    assert NodeEvent.objects.filter(node=node, type=fleet_events.LIFECYCLE, to_state="maintenance").count() == 1


def test_moving_the_deadline_later_makes_the_old_timer_harmless(operator_api, node, clock):
    make_lease(node, "job-1", ttl=7200)
    drain = start(operator_api, node, deadline_in=600)

    response = operator_api.post(
        f"/api/v1/drains/{drain.pk}/deadline", {"reason": "vendor late", "deadline_in": 3600}, HTTP_IF_MATCH='"1"'
    )
    assert response.status_code == 200
    assert response.json()["version"] == 2
    run_for(clock, 601)
    tasks.enforce_drain_deadline(str(drain.pk))  # the old timer
    drain.refresh_from_db()
    assert drain.state == "active"
    run_for(clock, 3000)
    tasks.enforce_drain_deadline(str(drain.pk))  # the new timer
    drain.refresh_from_db()
    assert drain.state == "forced"


def test_a_deadline_change_needs_the_drain_version_and_a_future_deadline(operator_api, node):
    make_lease(node, "job-1")
    drain = start(operator_api, node)
    url = f"/api/v1/drains/{drain.pk}/deadline"

    missing = operator_api.post(url, {"reason": "r", "deadline_in": 60})
    stale = operator_api.post(url, {"reason": "r", "deadline_in": 60}, HTTP_IF_MATCH='"9"')
    past = operator_api.post(url, {"reason": "r", "deadline": (T0 - timedelta(1)).isoformat()}, HTTP_IF_MATCH='"1"')
    neither = operator_api.post(url, {"reason": "r"}, HTTP_IF_MATCH='"1"')

    assert (missing.status_code, stale.status_code, past.status_code, neither.status_code) == (428, 412, 422, 400)
    assert past.json()["code"] == "deadline_in_past"
    drain.refresh_from_db()
    assert drain.version == 1


def test_cancelling_a_drain_removes_only_the_drains_own_hold(operator_api, node):
    lease = make_lease(node, "job-1")
    drain = start(operator_api, node, policy="checkpoint")

    response = operator_api.post(f"/api/v1/drains/{drain.pk}/cancel", {"reason": "window moved"}, HTTP_IF_MATCH='"1"')
    again = operator_api.post(f"/api/v1/drains/{drain.pk}/cancel", {"reason": "twice"}, HTTP_IF_MATCH='"2"')

    assert response.status_code == 200
    assert response.json()["state"] == "cancelled"
    assert response.json()["node"]["lifecycle"] == "ready"
    node.refresh_from_db()
    assert node.cordoned is False
    assert node.holds.get().owner == f"drain:{drain.pk}" and node.holds.get().removed_at is not None
    assert again.status_code == 409
    assert again.json()["code"] == "drain_not_active"
    lease.refresh_from_db()
    assert lease.state == "active"
    assert lease.checkpoint_requested_at is None  # the checkpoint request is withdrawn


def test_cancelling_with_a_stale_drain_version_is_412(operator_api, node):
    make_lease(node, "job-1")
    drain = start(operator_api, node)

    response = operator_api.post(f"/api/v1/drains/{drain.pk}/cancel", {"reason": "r"}, HTTP_IF_MATCH='"5"')

    assert response.status_code == 412
    drain.refresh_from_db()
    assert drain.state == "active"


@pytest.mark.parametrize(
    ("body", "query", "status", "code"),
    [
        ({"reason": "r", "deadline_in": 600, "policy": "evaporate"}, "", 400, "validation_error"),
        ({"reason": "r"}, "", 400, "validation_error"),
        ({"reason": "r", "deadline_in": 600, "deadline": "2030-01-01T00:00:00Z"}, "", 400, "validation_error"),
        ({"reason": "r", "deadline": "2020-01-01T00:00:00Z"}, "", 422, "deadline_in_past"),
        ({"reason": "r", "deadline": "2099-01-01T00:00:00Z"}, "", 422, "deadline_too_far"),
        ({"reason": "r", "deadline_in": 99_999_999}, "", 422, "deadline_too_far"),
        ({"reason": "r", "deadline_in": 2**62}, "", 422, "deadline_too_far"),  # no datetime overflow (500)
        ({"reason": "r", "deadline_in": 600, "dry_run": True}, "", 400, "unknown_field"),  # ?dry_run=true, not the body
        ({"reason": "r", "deadline_in": 600, "policy": "checkpoint", "polcy": "wait"}, "", 400, "unknown_field"),
        ({"reason": "r", "deadline": "tomorrow"}, "", 400, "validation_error"),
        ({"reason": "r", "deadline_in": 0}, "", 400, "validation_error"),
        ({"reason": "r", "deadline_in": 600}, "?dry_run=maybe", 400, "invalid_query_parameter"),
    ],
)
def test_bad_drain_requests_are_4xx_and_change_nothing(operator_api, node, body, query, status, code):
    response = act(operator_api, node, "drain", body, query=query)

    assert response.status_code == status, response.json()
    assert response.json()["code"] == code
    node.refresh_from_db()
    assert (node.lifecycle, node.version) == ("ready", 1)
    assert not Drain.objects.exists()


def test_drains_are_listed_and_filtered_for_operators_and_owners_see_their_own(
    operator_api, owner_api, owner, other_owner, node, clock
):
    from tests.factories import make_schedulable_node as make

    theirs, _ = make(owner=other_owner)
    node.owner = owner
    node.save(update_fields=["owner"])
    make_lease(node, "job-1")
    mine = start(operator_api, node)
    start(operator_api, theirs)

    listed = operator_api.get("/api/v1/drains?state=active")
    owned = owner_api.get("/api/v1/drains")
    detail = owner_api.get(f"/api/v1/drains/{mine.pk}")
    bad_filter = operator_api.get("/api/v1/drains?state=sideways")

    assert listed.json()["count"] == 1  # the other node had no leases: its drain completed
    assert [d["id"] for d in owned.json()["results"]] == [str(mine.pk)]
    assert detail.status_code == 200
    assert detail["ETag"] == etag_for(1, detail.json())
    assert detail.json()["progress"]["leases_remaining"] == 1
    assert bad_filter.status_code == 400


def test_a_checkpoint_request_is_made_once_and_a_cancel_withdraws_it_from_the_budget(operator_api, node, clock):
    from maintenance.budgets import budget_status
    from maintenance.models import DisruptionBudget

    budget = DisruptionBudget.objects.create(group="web", max_unavailable=5)
    lease = make_lease(node, "web-1", group="web")
    drain = start(operator_api, node, policy="checkpoint")
    clock.shift(10)
    Lease.objects.filter(pk=lease.pk).update(checkpoint_requested_at=None)  # answered, not yet checkpointed
    evaluate(drain)

    assert Eviction.objects.filter(drain=drain, kind="checkpoint").count() == 1  # not asked twice
    assert budget_status(budget, now=T0 + timedelta(seconds=10)).disrupted == 1

    operator_api.post(f"/api/v1/drains/{drain.pk}/cancel", {"reason": "postponed"}, HTTP_IF_MATCH='"1"')

    status = budget_status(budget, now=T0 + timedelta(seconds=10))
    assert (status.healthy, status.disrupted, status.allowed_disruptions) == (1, 0, 5)


def test_the_sweep_skips_a_drain_that_fails_and_evaluates_the_rest(operator_api, node, clock, monkeypatch):
    other = make_schedulable_node()[0]
    for target in (node, other):
        make_lease(target, f"job-{target.pk}")
    broken, fine = start(operator_api, node, deadline_in=600), start(operator_api, other, deadline_in=600)
    real = drains.evaluate_drain

    def flaky(*, drain_id, actor, now=None):
        if drain_id == broken.pk:
            raise RuntimeError("bad row")
        return real(drain_id=drain_id, actor=actor, now=now)

    monkeypatch.setattr(drains, "evaluate_drain", flaky)
    clock.shift(601)
    counts = tasks.sweep_drains()

    assert (counts["failed"], counts["forced"]) == (1, 1)
    fine.refresh_from_db()
    assert fine.state == "forced"


def test_the_beat_entry_expires_before_its_next_run():
    from maintenance.schedule import BEAT_SCHEDULE

    entry = BEAT_SCHEDULE["maintenance-sweep-drains"]
    assert entry["task"] == tasks.sweep_drains.name
    assert entry["options"]["expires"] < entry["schedule"]


def test_starting_a_drain_queues_the_deadline_task_with_eta_equal_to_the_deadline(
    operator_api, node, clock, monkeypatch, django_capture_on_commit_callbacks
):
    make_lease(node, "job-1")
    sent = []
    monkeypatch.setattr(
        tasks.enforce_drain_deadline,
        "apply_async",
        lambda args=None, kwargs=None, **options: sent.append((list(args), options)),
    )

    with django_capture_on_commit_callbacks(execute=True):
        drain = start(operator_api, node, deadline_in=600)

    assert sent == [([str(drain.pk)], {"eta": drain.deadline})]
    assert drain.deadline == T0 + timedelta(seconds=600)


def test_a_renewal_after_a_lease_ended_does_not_confirm_the_node_stopped_it(clock):
    """Only a status report says which leases a node runs: a drain whose lease was revoked keeps
    waiting through renewals (which move last_heartbeat_at), and completes on the first status
    report that no longer lists the lease."""
    from fleet.credentials import issue_credential
    from operations import outofservice
    from tests.fleet.test_renewals import renew
    from tests.heartbeat_support import send

    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-1", resources={"cpu": 500}, ttl=3600)
    Lease.objects.filter(pk=lease.pk).update(command=["sleep", "600"])
    listed = [{"lease_id": str(lease.pk), "fencing_token": lease.fencing_token, "state": "running"}]
    assert send(node, 1, 1, leases=listed).applied
    drain = outofservice.take_out_of_service(
        node=node, owner=outofservice.AUTOSCALER, policy="wait", reason="scale-down", timeout=1800
    )
    clock.shift(5)
    lease_reconcile.revoke_lease(Lease.objects.get(pk=lease.pk), actor=SYSTEM, reason="done")
    _, secret = issue_credential(node=node, issuer="test", ttl_seconds=3600)
    clock.shift(5)
    assert renew(node, secret, incarnation=1, sequence=2).json()["code"] == "applied"
    assert drains.evaluate_drain(drain_id=drain.pk, actor=SYSTEM).state == "active"

    clock.shift(5)
    assert send(node, 3, 1, leases=[]).applied
    assert drains.evaluate_drain(drain_id=drain.pk, actor=SYSTEM).state == "completed"
