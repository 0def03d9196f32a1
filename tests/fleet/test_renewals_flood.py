"""The flood guard (429 + Retry-After), StatusReportOverdue, and instructions reaching a node at its next renewal."""

from __future__ import annotations

import pytest

from fleet import event_types as fleet_events
from fleet.choices import Liveness
from fleet.instructions import Instruction
from fleet.liveness_sweep import sweep_liveness
from fleet.models import Node, NodeEvent, Pool
from fleet.selectors import unschedulable_reasons
from tests.factories import PoolFactory, make_schedulable_node
from tests.fleet.test_renewals import renew
from tests.heartbeat_support import T0, node_api, post_beat, seconds
from tests.maintenance_support import act

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clock_at_t0")]


@pytest.fixture
def node_secret():
    return make_schedulable_node(PoolFactory(name="general"))


def at(time_machine, second: float):
    time_machine.move_to(T0 + seconds(second), tick=False)


# --- flood guard ------------------------------------------------------------------------------


def test_a_renewal_sooner_than_half_the_interval_gets_429_with_retry_after_and_writes_nothing(
    node_secret, time_machine
):
    node, secret = node_secret
    assert renew(node, secret, sequence=1).json()["applied"] is True
    at(time_machine, 3)
    response = renew(node, secret, sequence=2)
    assert response.status_code == 429 and response.json()["code"] == "too_many_requests"
    assert response["Retry-After"] == "2" and response.json()["retry_after"] == 2
    node.refresh_from_db()
    assert node.sequence == 1 and node.last_heartbeat_at == T0
    at(time_machine, 5)
    assert renew(node, secret, sequence=2).json()["applied"] is True


def test_a_repeated_429_is_answered_by_the_early_gate_alike_and_without_a_query(node_secret, time_machine, monkeypatch):
    """fleet.api.renewal_views.RenewalFloodGate: the same problem, Retry-After and counter as the
    view's, before sessions, authentication and the database; anything it does not remember
    (another credential, another incarnation) still goes to the view."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from fleet.metrics import HEARTBEATS

    node, secret = node_secret
    assert renew(node, secret, sequence=1).json()["applied"] is True
    at(time_machine, 3)
    first = renew(node, secret, sequence=2)  # the view's 429, now remembered
    refused = HEARTBEATS.labels(kind="renewal", outcome="too_many_requests")._value.get()
    at(time_machine, 4)
    from fleet import renewals

    view_calls = []
    real_renew = renewals.renew
    monkeypatch.setattr(renewals, "renew", lambda **kw: view_calls.append(kw) or real_renew(**kw))
    with CaptureQueriesContext(connection) as queries:
        again = renew(node, secret, sequence=3)
    assert len(queries) == 0 and view_calls == []
    assert (again.status_code, again["Retry-After"], again.json()["code"]) == (429, "1", first.json()["code"])
    assert again["Content-Type"] == first["Content-Type"] and again["X-Request-ID"]
    assert HEARTBEATS.labels(kind="renewal", outcome="too_many_requests")._value.get() == refused + 1
    assert renew(node, secret[:-4] + "AAAA", sequence=4).status_code == 401  # not the refused credential
    assert renew(node, secret, incarnation=2, sequence=0).status_code == 200  # a new incarnation: the view


def test_each_message_kind_has_its_own_spacing(node_secret, time_machine):
    node, secret = node_secret
    assert post_beat(node_api(secret), node, sequence=1).status_code == 200
    at(time_machine, 1)
    assert renew(node, secret, sequence=2).status_code == 200  # a renewal right after a report is fine
    at(time_machine, 2)
    refused = post_beat(node_api(secret), node, sequence=3)
    assert refused.status_code == 429 and refused["Retry-After"] == "3"
    assert refused.json()["code"] == "too_many_requests"
    assert Node.objects.get(pk=node.pk).sequence == 2


def test_a_status_report_a_flag_asked_for_is_exempt(node_secret, time_machine):
    node, secret = node_secret
    post_beat(node_api(secret), node, sequence=1)
    Node.objects.filter(pk=node.pk).update(instructions=Instruction.LEASES)
    at(time_machine, 1)
    assert post_beat(node_api(secret), node, sequence=2).json()["applied"] is True
    assert Node.objects.get(pk=node.pk).instructions == 0


def test_the_first_report_of_a_new_incarnation_is_exempt(node_secret, time_machine):
    node, secret = node_secret
    post_beat(node_api(secret), node, sequence=1)
    at(time_machine, 1)
    restarted = post_beat(node_api(secret), node, incarnation=2, sequence=0)
    assert restarted.status_code == 200 and restarted.json()["applied"] is True


def test_the_first_message_after_the_interval_changed_is_exempt(node_secret, time_machine):
    node, secret = node_secret
    renew(node, secret, sequence=1)
    Pool.objects.filter(pk=node.pool_id).update(heartbeat_interval=5)
    from fleet.renewals import forget_cached_timings

    forget_cached_timings()
    at(time_machine, 1)
    answer = renew(node, secret, sequence=2)
    assert answer.status_code == 200 and answer.json()["renewal_interval"] == 5
    assert 3 <= answer.json()["next_renewal_in"] <= 7
    at(time_machine, 2)
    assert renew(node, secret, sequence=3).status_code == 429  # now spaced by half of 5 s


def test_a_flooding_node_never_changes_another_nodes_liveness(node_secret, time_machine):
    flooder, secret = node_secret
    quiet, quiet_secret = make_schedulable_node(flooder.pool)
    renew(flooder, secret, sequence=1)
    renew(quiet, quiet_secret, sequence=1)
    refused = [renew(flooder, secret, sequence=s).status_code for s in range(2, 52)]
    assert set(refused) == {429}
    assert Node.objects.get(pk=flooder.pk).sequence == 1
    at(time_machine, 10)
    assert renew(quiet, quiet_secret, sequence=2).json()["applied"] is True
    assert Node.objects.get(pk=quiet.pk).liveness == Liveness.ALIVE


# --- StatusReportOverdue ----------------------------------------------------------------------


def test_a_node_that_renews_but_stops_reporting_gets_status_report_overdue_and_keeps_its_liveness(
    node_secret, time_machine
):
    node, secret = node_secret
    post_beat(node_api(secret), node, sequence=1)
    sequence = 1
    for second in range(10, 131, 10):
        at(time_machine, second)
        sequence += 1
        assert renew(node, secret, sequence=sequence).json()["applied"] is True
        summary = sweep_liveness()
    node.refresh_from_db()
    assert summary["status_reports_overdue"] == 0  # marked once, at the first sweep past 120 s
    assert node.status_report_overdue is True and node.liveness == Liveness.ALIVE
    overdue = next(c for c in node.conditions if c["type"] == "StatusReportOverdue")
    assert overdue["status"] == "True"
    assert [r["code"] for r in unschedulable_reasons(node)] == ["status_report_overdue"]
    events = NodeEvent.objects.filter(node=node, type=fleet_events.CONDITION, reason__startswith="StatusReportOverdue")
    assert events.count() == 1
    # The next renewal asks for the report, and the report clears the condition.
    at(time_machine, 140)
    flags = renew(node, secret, sequence=sequence + 1).json()["flags"]
    assert flags & Instruction.STATUS_REPORT
    assert post_beat(node_api(secret), node, sequence=sequence + 2).json()["applied"] is True
    node.refresh_from_db()
    assert node.status_report_overdue is False
    assert all(c["type"] != "StatusReportOverdue" for c in node.conditions)
    assert unschedulable_reasons(node) == []


def test_a_node_cannot_report_the_overdue_condition_itself(node_secret):
    node, secret = node_secret
    condition = {"type": "StatusReportOverdue", "status": "True", "reason": "x", "message": ""}
    post_beat(node_api(secret), node, sequence=1, conditions=[condition])
    node.refresh_from_db()
    assert all(c["type"] != "StatusReportOverdue" for c in node.conditions) and not node.status_report_overdue


# --- instructions reach the node at its next renewal ------------------------------------------


def test_a_lease_granted_shows_up_at_the_next_renewal(
    node_secret, client_api, time_machine, django_capture_on_commit_callbacks
):
    node, secret = node_secret
    post_beat(node_api(secret), node, sequence=1)
    with django_capture_on_commit_callbacks(execute=True):  # the bit is raised once the grant commits
        granted = client_api.post(
            "/api/v1/node-leases",
            {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "1"}, "command": ["sleep", "1"]},
            format="json",
        )
    assert granted.status_code == 201
    at(time_machine, 10)
    assert renew(node, secret, sequence=2).json()["flags"] & Instruction.LEASES
    report = post_beat(node_api(secret), node, sequence=3).json()
    assert [lease["lease_id"] for lease in report["leases"]] == [granted.json()["id"]]
    at(time_machine, 20)
    assert renew(node, secret, sequence=4).json()["flags"] == 0


def test_a_drain_started_shows_up_at_the_next_renewal(
    node_secret, operator_api, time_machine, django_capture_on_commit_callbacks
):
    node, secret = node_secret
    post_beat(node_api(secret), node, sequence=1)
    with django_capture_on_commit_callbacks(execute=True):
        drained = act(operator_api, node, "drain", {"reason": "kernel update", "deadline_in": 600})
    assert drained.status_code == 201
    at(time_machine, 10)
    assert renew(node, secret, sequence=2).json()["flags"] & Instruction.LIFECYCLE
    report = post_beat(node_api(secret), node, sequence=3).json()
    assert report["lifecycle"] == "maintenance"  # no leases: the drain completed at once


def test_a_flooding_credential_is_refused_without_a_statement_after_its_first_refusal(node_secret, time_machine):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    node, secret = node_secret
    renew(node, secret, sequence=1)
    assert renew(node, secret, sequence=2).status_code == 429
    with CaptureQueriesContext(connection) as queries:
        assert renew(node, secret, sequence=3).status_code == 429
    assert len(queries) == 0
    # Another credential string for the same node is not trusted by the memo: it is checked in full.
    assert renew(node, secret[:-4] + "abcd", sequence=4).status_code == 401
    at(time_machine, 5)
    assert renew(node, secret, sequence=5).json()["applied"] is True


def test_a_new_incarnation_with_every_report_does_not_flood_through_the_exemption(node_secret, time_machine):
    """The first report of a new incarnation is exempt from the spacing, once: a second restart
    inside the spacing is refused like any other report (an agent crash-looping, or one that
    bumps its incarnation to get past the guard)."""
    node, secret = node_secret
    api = node_api(secret)
    assert post_beat(api, node, sequence=1, incarnation=1).status_code == 200
    at(time_machine, 1)
    assert post_beat(api, node, sequence=0, incarnation=2).status_code == 200  # a restart: exempt
    at(time_machine, 2)
    refused = post_beat(api, node, sequence=0, incarnation=3)
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    assert NodeEvent.objects.filter(node=node, type=fleet_events.RESTART).count() == 1
    assert Node.objects.get(pk=node.pk).incarnation == 2
    at(time_machine, 7)
    assert post_beat(api, node, sequence=0, incarnation=3).status_code == 200  # past the spacing


def test_renewals_and_status_reports_tell_one_interval_so_a_pool_edit_lifts_no_guard(node_secret, time_machine):
    """Both message kinds use the same per-process timings: after a pool's interval changes they
    do not each find "the interval changed" after the other, which exempted every message."""
    node, secret = node_secret
    api = node_api(secret)
    assert renew(node, secret, sequence=1).json()["applied"] is True
    Pool.objects.filter(pk=node.pool_id).update(heartbeat_interval=20)
    codes = []
    for i in range(10):
        at(time_machine, 1 + i * 0.1)
        if i % 2:
            codes.append(renew(node, secret, sequence=2 + i).status_code)
        else:
            codes.append(post_beat(api, node, sequence=2 + i).status_code)
    assert codes.count(429) >= 8, codes
