"""POST /api/v1/nodes/{id}/renewals: the liveness renewal (one statement), its rules and its flags."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from fleet import event_types as fleet_events
from fleet.choices import Lifecycle, Liveness
from fleet.credentials import issue_credential, revoke_all_credentials
from fleet.instructions import Instruction, post_instructions
from fleet.liveness_sweep import sweep_liveness
from fleet.metrics import HEARTBEATS
from fleet.models import Node, NodeEvent
from tests.factories import PoolFactory, make_schedulable_node, set_lifecycle
from tests.heartbeat_support import T0, node_api, post_beat, seconds

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clock_at_t0")]


@pytest.fixture
def node_secret():
    return make_schedulable_node(PoolFactory(name="general"))


def renew(node, secret, *, incarnation=1, sequence=1, body=None, content_type="application/json"):
    """One renewal through the real URL (a plain Django test client: the view is not DRF)."""
    raw = body if body is not None else json.dumps({"incarnation": incarnation, "sequence": sequence})
    return Client().post(
        f"/api/v1/nodes/{node.pk}/renewals", raw, content_type=content_type, HTTP_AUTHORIZATION=f"Node {secret}"
    )


def counted(outcome: str) -> float:
    return HEARTBEATS.labels(kind="renewal", outcome=outcome)._value.get()


def test_a_renewal_is_applied_with_one_statement_and_answers_in_a_few_bytes(node_secret, time_machine):
    node, secret = node_secret
    time_machine.move_to(T0 + seconds(3), tick=False)
    renew(node, secret, sequence=1)  # learns the node's pool in this process
    time_machine.move_to(T0 + seconds(13), tick=False)
    with CaptureQueriesContext(connection) as queries:
        response = renew(node, secret, sequence=2)
    assert response.status_code == 200
    assert len(response.content) < 100
    body = response.json()
    assert body["applied"] is True and body["code"] == "applied" and body["flags"] == 0
    assert 0.6 * 10 <= body["next_renewal_in"] <= 1.4 * 10 and body["renewal_interval"] == 10  # the node's slot
    assert len(queries) == 1 and queries[0]["sql"].startswith("UPDATE")
    node.refresh_from_db()
    assert node.sequence == 2 and node.last_heartbeat_at == T0 + seconds(13)
    assert node.next_liveness_check_at == T0 + seconds(33) and node.liveness == Liveness.ALIVE


@pytest.mark.skipif(connection.vendor != "postgresql", reason="prepared statements are PostgreSQL's")
def test_renewals_run_as_a_prepared_statement_and_keep_every_rule(node_secret, time_machine):
    """On one connection the UPDATE is prepared at its first execution (nodepool.db): the answers
    stay right however often it runs."""
    runs = 6

    node, secret = node_secret
    for sequence in range(1, runs + 4):
        time_machine.move_to(T0 + seconds(10 * sequence), tick=False)
        assert renew(node, secret, sequence=sequence).json()["code"] == "applied"
    assert renew(node, secret, sequence=sequence).json()["code"] != "applied"  # a repeated sequence
    other, other_secret = make_schedulable_node(node.pool)
    assert renew(node, other_secret, sequence=sequence + 1).status_code == 403

    with connection.cursor() as cursor:
        cursor.execute("SELECT generic_plans FROM pg_prepared_statements WHERE statement LIKE '%% AS UPDATE %%'")
        assert [row[0] for row in cursor.fetchall() if row[0] >= 1], "the renewal was not prepared"
    node.refresh_from_db()
    assert node.sequence == runs + 3 and node.last_heartbeat_at == T0 + seconds(10 * node.sequence)


def test_a_renewal_keeps_a_node_alive_without_status_reports(node_secret, time_machine):
    node, secret = node_secret
    for step in range(1, 6):
        time_machine.move_to(T0 + seconds(10 * step), tick=False)
        assert renew(node, secret, sequence=step).json()["applied"] is True
        sweep_liveness()
    node.refresh_from_db()
    assert node.liveness == Liveness.ALIVE
    assert not NodeEvent.objects.filter(node=node, type=fleet_events.LIVENESS).exists()


def test_a_renewal_revives_a_stale_node_with_a_liveness_event(node_secret, time_machine):
    node, secret = node_secret
    Node.objects.filter(pk=node.pk).update(liveness=Liveness.STALE)  # as the sweep leaves a silent node
    time_machine.move_to(T0 + seconds(25), tick=False)
    response = renew(node, secret, sequence=1)
    assert response.json()["applied"] is True
    node.refresh_from_db()
    assert node.liveness == Liveness.ALIVE and node.liveness_changed_at == T0 + seconds(25)
    revived = NodeEvent.objects.filter(node=node, type=fleet_events.LIVENESS, to_state=Liveness.ALIVE)
    assert [(e.from_state, e.reason) for e in revived] == [(Liveness.STALE, "renewal received")]


@pytest.mark.parametrize(
    ("separator", "applied"),
    [(" ", True), ("\t", True), ("  ", True), ("\xa0", False), ("\x85", False)],
)
def test_the_authorization_header_splits_on_ascii_whitespace_only_as_drf_and_the_proxy_do(
    node_secret, separator, applied
):
    # A no-break space (0xA0) or NEL (0x85) is whitespace to str.split but not to DRF, nor to the
    # proxy's per-credential bucket (deploy/nginx): accepting it would let a node flood unbucketed.
    node, secret = node_secret
    response = Client().post(
        f"/api/v1/nodes/{node.pk}/renewals", json.dumps({"incarnation": 1, "sequence": 1}),
        content_type="application/json", HTTP_AUTHORIZATION=f"Node{separator}{secret}",
    )  # fmt: skip

    if applied:
        assert response.status_code == 200 and response.json()["applied"] is True
    else:
        assert response.status_code == 401 and response.json()["reason"] == "credential_missing"
        assert Node.objects.get(pk=node.pk).sequence == node.sequence


@pytest.mark.parametrize(
    ("incarnation", "sequence", "code"),
    [(1, 5, "duplicate_sequence"), (1, 4, "stale_sequence"), (0 + 1, 0, "stale_sequence")],
)
def test_ordering_codes_hold_for_renewals_and_change_nothing(node_secret, time_machine, incarnation, sequence, code):
    node, secret = node_secret
    Node.objects.filter(pk=node.pk).update(sequence=5)
    response = renew(node, secret, incarnation=incarnation, sequence=sequence)
    assert response.status_code == 200
    assert response.json()["applied"] is False and response.json()["code"] == code
    assert Node.objects.get(pk=node.pk).sequence == 5


def test_an_older_incarnation_is_stale_and_a_newer_one_asks_for_a_status_report(node_secret):
    node, secret = node_secret
    Node.objects.filter(pk=node.pk).update(incarnation=3, sequence=0)
    assert renew(node, secret, incarnation=2, sequence=9).json()["code"] == "stale_incarnation"
    newer = renew(node, secret, incarnation=4, sequence=0).json()
    assert newer["applied"] is False and newer["code"] == "status_report_required"
    assert newer["flags"] & Instruction.STATUS_REPORT
    node.refresh_from_db()
    assert (node.incarnation, node.sequence, node.restart_count) == (3, 0, 0)


def test_a_retired_node_gets_410_and_nothing_is_written(node_secret):
    node, secret = node_secret
    set_lifecycle(node, Lifecycle.RETIRED)
    before = Node.objects.get(pk=node.pk).last_heartbeat_at
    response = renew(node, secret)
    assert response.status_code == 410 and response.json()["code"] == "node_retired"
    assert response["Content-Type"] == "application/problem+json"
    assert Node.objects.get(pk=node.pk).last_heartbeat_at == before


def test_another_nodes_credential_gets_403(node_secret):
    node, _ = node_secret
    _, other_secret = make_schedulable_node(node.pool)
    response = renew(node, other_secret)
    assert response.status_code == 403 and response.json()["code"] == "forbidden"
    assert Node.objects.get(pk=node.pk).sequence == node.sequence


def test_revoked_expired_unknown_and_missing_credentials_get_401(node_secret, time_machine):
    node, secret = node_secret
    assert renew(node, "npn_nonsense").json()["reason"] == "credential_malformed"
    assert renew(node, secret[:-4] + "abcd").json()["reason"] == "credential_invalid"
    missing = Client().post(f"/api/v1/nodes/{node.pk}/renewals", "{}", content_type="application/json")
    assert missing.status_code == 401 and missing["WWW-Authenticate"] == "Node"
    revoke_all_credentials(node=node)
    revoked = renew(node, secret)
    assert revoked.status_code == 401 and revoked.json()["reason"] == "credential_revoked"
    _, fresh = issue_credential(node=node, issuer="test")
    time_machine.move_to(T0 + seconds(10 * 24 * 3600), tick=False)
    expired = renew(node, fresh)
    assert expired.status_code == 401 and expired.json()["reason"] == "credential_expired"
    assert Node.objects.get(pk=node.pk).sequence == node.sequence


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ("not json", 400, "malformed_body"),
        ("[1, 2]", 400, "validation_error"),
        ('{"incarnation": 1}', 400, "validation_error"),
        ('{"incarnation": 0, "sequence": 1}', 400, "validation_error"),
        ('{"incarnation": true, "sequence": 1}', 400, "validation_error"),
        ('{"incarnation": 1, "sequence": 9007199254740992}', 400, "validation_error"),
        ('{"incarnation": 1, "sequence": 1, "ready": true}', 400, "validation_error"),
        ('{"incarnation": 1, "sequence": 1, "pad": "' + "x" * 300 + '"}', 413, "payload_too_large"),
        # The strict parser of every endpoint: no guessing which of two sequences was meant.
        ('{"incarnation": 1, "sequence": 1, "sequence": 7}', 400, "duplicate_key"),
        ('\ufeff{"incarnation": 1, "sequence": 1}', 400, "malformed_body"),
        ('{"incarnation": 1, "sequence": 1e2}', 400, "validation_error"),
    ],
)
def test_a_malformed_or_oversized_renewal_is_refused_and_nothing_is_written(node_secret, body, status, code):
    node, secret = node_secret
    response = renew(node, secret, body=body)
    assert response.status_code == status and response.json()["code"] == code
    assert response["Content-Type"] == "application/problem+json"
    assert Node.objects.get(pk=node.pk).sequence == node.sequence


def test_a_renewal_must_be_json_and_posted(node_secret):
    node, secret = node_secret
    assert renew(node, secret, content_type="text/plain").status_code == 415
    response = Client().get(f"/api/v1/nodes/{node.pk}/renewals", HTTP_AUTHORIZATION=f"Node {secret}")
    assert response.status_code == 405 and response.json()["code"] == "method_not_allowed"


def test_flags_say_what_waits_and_a_status_report_clears_them(node_secret, time_machine):
    node, secret = node_secret
    post_instructions([node.pk], Instruction.LEASES | Instruction.LIFECYCLE, on_commit=False)
    flags = renew(node, secret, sequence=1).json()["flags"]
    assert flags == Instruction.LEASES | Instruction.LIFECYCLE
    # The flag asked for a status report: it is exempt from the flood guard, and clears the marker.
    report = post_beat(node_api(secret), node, sequence=2)
    assert report.status_code == 200 and report.json()["applied"] is True
    time_machine.move_to(T0 + seconds(10), tick=False)
    assert renew(node, secret, sequence=3).json()["flags"] == 0


def test_the_rotation_flag_comes_when_a_quarter_of_the_credential_is_left(node_secret, time_machine):
    node, secret = node_secret
    assert not renew(node, secret, sequence=1).json()["flags"] & Instruction.ROTATE_CREDENTIAL
    time_machine.move_to(T0 + seconds(19 * 3600), tick=False)
    assert renew(node, secret, sequence=2).json()["flags"] & Instruction.ROTATE_CREDENTIAL


def test_outcomes_are_counted_by_kind_and_code(node_secret):
    node, secret = node_secret
    applied, duplicate = counted("applied"), counted("duplicate_sequence")
    renew(node, secret, sequence=1)
    renew(node, secret, sequence=1)
    assert counted("applied") == applied + 1 and counted("duplicate_sequence") == duplicate + 1


def test_a_node_that_stops_renewing_is_never_stale_early_and_unreachable_exactly_at_the_grace(
    node_secret, time_machine
):
    node, secret = node_secret
    renew(node, secret, sequence=1)
    time_machine.move_to(T0 + seconds(10), tick=False)
    renew(node, secret, sequence=2)  # the last renewal: stale is due 20 s after it, unreachable 40 s
    for second, expected in ((29.9, Liveness.ALIVE), (30, Liveness.STALE), (49.9, Liveness.STALE)):
        time_machine.move_to(T0 + seconds(second), tick=False)
        sweep_liveness()
        assert Node.objects.get(pk=node.pk).liveness == expected, second
    time_machine.move_to(T0 + seconds(50), tick=False)
    sweep_liveness()
    assert Node.objects.get(pk=node.pk).liveness == Liveness.UNREACHABLE


def test_a_superseded_credential_after_its_overlap_revokes_the_lineage_as_on_every_node_endpoint(
    node_secret, time_machine
):
    from fleet.models import NodeCredential
    from fleet.services import node_credential_rotate

    node, secret = node_secret
    old = NodeCredential.objects.get(node=node)
    node_credential_rotate(node=node, credential=old, agent_version="1.0.0", now=T0)
    time_machine.move_to(T0 + seconds(3600), tick=False)
    response = renew(node, secret, sequence=1)
    assert response.status_code == 401 and response.json()["reason"] == "credential_superseded"
    assert not NodeCredential.objects.filter(node=node, revoked_at__isnull=True).exists()


def test_a_credential_that_looks_expired_after_a_clock_jump_still_renews(node_secret, time_machine):
    """A forward jump of the control plane's clock that no sweep has noticed yet: the renewal
    judges the credential at control-plane time, as every node endpoint does (fleet.clock)."""
    node, _ = node_secret
    _, secret = issue_credential(node=node, issuer="test", ttl_seconds=3600)
    sweep_liveness()  # the clock is observed at T0
    time_machine.move_to(T0 + seconds(3 * 3600), tick=False)
    response = renew(node, secret, incarnation=node.incarnation, sequence=node.sequence + 1)
    assert response.status_code == 200 and response.json()["code"] == "applied"
    time_machine.move_to(T0 + seconds(3 * 3600 + 30), tick=False)
    sweep_liveness()  # the gap is detected and paused: the credential's deadline moved with it
    response = renew(node, secret, incarnation=node.incarnation, sequence=node.sequence + 2)
    assert response.status_code == 200 and response.json()["code"] == "applied"


def test_the_flood_gate_never_reads_a_chunked_body_before_the_body_limit_has(node_secret):
    """Without a Content-Length (chunked), reading request.body in the gate cached an empty body
    for the view: every chunked renewal on that process failed while any 429 was remembered."""
    from django.test import RequestFactory

    from fleet.api.renewal_views import RenewalFloodGate

    node, secret = node_secret
    request = RequestFactory().post(
        f"/api/v1/nodes/{node.pk}/renewals", '{"incarnation": 1, "sequence": 2}',
        content_type="application/json", HTTP_AUTHORIZATION=f"Node {secret}",
    )  # fmt: skip
    del request.META["CONTENT_LENGTH"]
    assert RenewalFloodGate._refusal(request, str(node.pk)) is None
    assert not hasattr(request, "_body")
