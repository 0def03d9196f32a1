"""The marketplace API: owners see only their own, bad input is a 4xx problem that changes nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from fleet.events import Actor
from fleet.models import Node
from leases.fencing import lease_release
from maintenance import services as maintenance
from marketplace.choices import UsageState
from marketplace.models import Appeal, OwnerSettings, PoolPrice, PoolSettlement, QuarantineGuidance, UsageRecord
from marketplace.reconciliation import reconcile_usage
from tests.marketplace_support import ACTOR, Reporter, at, grant_at, owned_node, priced_pool

pytestmark = pytest.mark.django_db
API = "/api/v1"
OPERATOR = Actor.system("operator-test")


@pytest.fixture
def pool():
    return priced_pool()


@pytest.fixture
def node(pool, owner):
    return owned_node(pool, owner, "mine")[0]


@pytest.fixture
def record(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-api", node=node)
    Reporter(node).every(10, 60, [lease])
    with time_machine.travel(at(65), tick=False):
        lease_release(
            lease_id=lease.pk,
            data={"fencing_token": lease.fencing_token, "node_incarnation": 1},
            user=client_user,
            actor=ACTOR,
        )
    return reconcile_usage(UsageRecord.objects.get(lease=lease).pk, actor=ACTOR, force=True)


def problem(response, status, code):
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    assert response.json()["code"] == code
    return response.json()


def test_an_owner_lists_and_reads_their_usage_with_execution_evidence(owner_api, record):
    listed = owner_api.get(f"{API}/usage-records").json()
    assert [r["id"] for r in listed["results"]] == [record.pk]
    detail = owner_api.get(f"{API}/usage-records/{record.pk}").json()
    assert (detail["state"], detail["billable_seconds"]) == ("reconciled", "50.000")
    execution = detail["execution"]
    assert [(i["started_at"], i["seconds"], i["close_reason"]) for i in execution["evidence_intervals"]] == [
        ("2026-11-02T10:00:10Z", 50.0, "lease_ended")
    ]
    for private in ("client", "command", "spec", "idempotency_key", "request_hash", "decision"):
        assert private not in execution


def test_another_owners_records_answer_404(record, other_owner):
    from tests.conftest import _api

    api = _api(other_owner)
    problem(api.get(f"{API}/usage-records/{record.pk}"), 404, "not_found")
    assert api.get(f"{API}/usage-records").json()["results"] == []
    statement = record.statement_line.statement
    assert api.get(f"{API}/statements/{statement.pk}").status_code == 404
    problem(api.get(f"{API}/statements/{statement.pk}/export.csv"), 404, "statement_not_found")
    assert api.get(f"{API}/owned-leases/{record.lease_id}").status_code == 404
    problem(api.get(f"{API}/nodes/{record.node_id}/quarantine-status"), 404, "node_not_found")


def test_clients_and_anonymous_callers_cannot_read_usage(client_api, anon_api, record):
    assert client_api.get(f"{API}/usage-records").status_code == 403
    assert anon_api.get(f"{API}/statements").status_code == 401


def test_usage_list_filters_refuse_junk(owner_api, record):
    problem(owner_api.get(f"{API}/usage-records?state=paid"), 400, "invalid_filter")
    problem(owner_api.get(f"{API}/usage-records?node=not-a-uuid"), 400, "invalid_filter")
    problem(owner_api.get(f"{API}/owned-leases?state=zombie"), 400, "invalid_filter")
    problem(owner_api.get(f"{API}/statements?state=closed"), 400, "invalid_filter")


def test_statement_exports_in_csv_and_json(owner_api, record):
    statement = record.statement_line.statement
    csv_answer = owner_api.get(f"{API}/statements/{statement.pk}/export.csv")
    assert csv_answer.status_code == 200 and csv_answer["Content-Type"].startswith("text/csv")
    assert "total" in csv_answer.content.decode()
    document = owner_api.get(f"{API}/statements/{statement.pk}/export.json").json()
    assert document["totals"] == {"EUR": "0.02"}  # 50 s x 1.21 EUR/h = 0.0168 -> 0.02
    problem(owner_api.get(f"{API}/statements/{statement.pk}/export.xml"), 404, "unknown_export_format")


def test_finalizing_needs_an_operator_and_the_version(owner_api, operator_api, record):
    statement = record.statement_line.statement
    assert owner_api.post(f"{API}/statements/{statement.pk}/finalize").status_code == 403
    problem(operator_api.post(f"{API}/statements/{statement.pk}/finalize"), 428, "version_required")
    problem(
        operator_api.post(f"{API}/statements/{statement.pk}/finalize", HTTP_IF_MATCH='"9"'), 412, "version_mismatch"
    )
    with time_machine.travel(at(3600), tick=False):  # inside the record's month, whatever today is
        problem(
            operator_api.post(f"{API}/statements/{statement.pk}/finalize", HTTP_IF_MATCH='"1"'), 409, "period_not_over"
        )
    statement.refresh_from_db()
    assert statement.state == "open"


def test_resolving_a_usage_record_validates_its_input(operator_api, record):
    url = f"{API}/usage-records/{record.pk}/resolve"
    problem(operator_api.post(url, {"decision": "shrug", "reason": "x"}, HTTP_IF_MATCH='"2"'), 400, "invalid_decision")
    problem(operator_api.post(url, {"decision": "accept"}, HTTP_IF_MATCH='"2"'), 400, "validation_error")
    problem(  # an unknown member (billable for billable_seconds) is refused, not ignored
        operator_api.post(url, {"decision": "accept", "reason": "x", "billable": "1"}, HTTP_IF_MATCH='"2"'),
        400,
        "unknown_field",
    )
    problem(
        operator_api.post(url, {"decision": "adjust", "reason": "x", "billable_seconds": 3}, HTTP_IF_MATCH='"2"'),
        400,
        "invalid_decimal",
    )
    problem(
        operator_api.post(url, {"decision": "adjust", "reason": "x", "billable_seconds": "99999"}, HTTP_IF_MATCH='"2"'),
        400,
        "invalid_decimal",
    )
    problem(operator_api.post(url, {"decision": "accept", "reason": "x"}), 428, "version_required")
    problem(
        operator_api.post(url, {"decision": "accept", "reason": "x"}, HTTP_IF_MATCH='"2"'), 409, "usage_not_disputed"
    )
    problem(operator_api.post(f"{API}/usage-records/999999/reconcile"), 404, "usage_record_not_found")
    record.refresh_from_db()
    assert (record.state, record.version) == (UsageState.RECONCILED, 2)


def test_operators_publish_price_versions_and_bad_prices_are_refused(operator_api, owner_api, pool):
    url = f"{API}/pool-prices"
    good = {
        "pool": pool.name,
        "resource": "nvidia.com/gpu",
        "unit_price": "2.50",
        "currency": "EUR",
        "effective_from": "2026-12-01T00:00:00Z",
    }
    created = operator_api.post(url, good)
    assert created.status_code == 201 and created.json()["unit_price"] == "2.500000"
    before = PoolPrice.objects.count()
    problem(owner_api.post(url, good), 403, "forbidden")
    problem(operator_api.post(url, good), 409, "price_version_exists")
    problem(
        operator_api.post(url, {**good, "currency": "USD", "effective_from": "2027-01-01T00:00:00Z"}),
        409,
        "currency_mismatch",
    )
    problem(operator_api.post(url, {**good, "unit_price": 2.5}), 400, "invalid_decimal")
    problem(operator_api.post(url, {**good, "unit_price": "-1"}), 400, "invalid_decimal")
    problem(operator_api.post(url, {**good, "unit_price": "NaN"}), 400, "invalid_decimal")
    problem(operator_api.post(url, {**good, "currency": "euro"}), 400, "invalid_currency")
    problem(
        operator_api.post(url, {**good, "effective_from": "2026-12-01"}), 400, "timezone_required"
    )  # no time, no offset
    problem(operator_api.post(url, {**good, "effective_from": "yesterday"}), 400, "invalid_datetime")
    problem(operator_api.post(url, {**good, "effective_from": "2026-12-01T00:00:00"}), 400, "timezone_required")
    problem(operator_api.post(url, {**good, "pool": "nope"}), 400, "unknown_pool")
    problem(operator_api.post(url, {**good, "resource": "CPU!"}), 400, "validation_error")
    assert problem(operator_api.post(url, ["not", "an", "object"]), 400, "malformed_body")["deprecated_code"] == (
        "invalid_body"
    )
    assert PoolPrice.objects.count() == before
    assert len(owner_api.get(f"{url}?pool={pool.name}").json()["results"]) == 3


def test_a_settlement_window_must_exceed_the_loss_threshold(operator_api, owner_api, pool):
    url = f"{API}/pools/{pool.name}/settlement"
    assert operator_api.get(url).json() == {
        "pool": pool.name,
        "settlement_window": None,
        "effective_window": 900.0,
        "period": "month",
        "idle_paid": False,
        "hold_multiple": "10.00",
        "appeal_alert_after": 604800,
    }
    problem(operator_api.put(url, {"settlement_window": 300}), 400, "settlement_window_too_short")
    problem(operator_api.put(url, {"settlement_window": "soon"}), 400, "validation_error")
    problem(operator_api.put(url, {"settlement_window": True}), 400, "validation_error")
    problem(operator_api.get(f"{API}/pools/none/settlement"), 404, "pool_not_found")
    assert owner_api.get(url).status_code == 403
    assert not PoolSettlement.objects.exists()
    assert operator_api.put(url, {"settlement_window": 7200}).json()["effective_window"] == 7200.0


def test_owner_settings_choose_the_statement_period(operator_api, owner_api, owner, other_owner):
    url = f"{API}/owner-settings/{owner.username}"
    assert owner_api.get(url).json() == {"owner": owner.username, "statement_period": "month"}
    problem(owner_api.put(url, {"statement_period": "week"}), 403, "forbidden")
    problem(operator_api.put(url, {"statement_period": "fortnight"}), 400, "validation_error")
    problem(owner_api.get(f"{API}/owner-settings/{other_owner.username}"), 404, "owner_not_found")
    assert operator_api.put(url, {"statement_period": "week"}).json()["statement_period"] == "week"
    assert OwnerSettings.objects.get(owner=owner).statement_period == "week"


def test_the_owner_of_a_quarantined_node_sees_reason_public_evidence_next_steps_and_appeals(
    owner_api, operator_api, node, operator
):
    QuarantineGuidance.objects.create(rule="manual", next_steps="Reinstall the agent, then appeal.")
    maintenance.quarantine_node(
        node_id=node.pk,
        reason="hash mismatch",
        actor=OPERATOR,
        evidence={"hash": "abc", "private": {"informant": "x"}, "ip_log": ["10.0.0.9"], "private_keys": ["ip_log"]},
    )
    status = owner_api.get(f"{API}/nodes/{node.pk}/quarantine-status").json()
    assert (status["rule"], status["reason"], status["open"], status["can_appeal"]) == (
        "manual",
        "hash mismatch",
        True,
        True,
    )
    assert status["evidence"] == {"hash": "abc"}
    assert status["next_steps"] == "Reinstall the agent, then appeal."
    # The maintenance API's quarantine reads hide the same private parts from owners.
    [quarantine] = owner_api.get(f"{API}/quarantines").json()["results"]
    assert quarantine["evidence"] == {"hash": "abc"}
    assert "informant" in str(operator_api.get(f"{API}/nodes/{node.pk}/quarantine-status").json()["evidence"])

    problem(owner_api.post(f"{API}/appeals", {"node": str(node.pk)}), 400, "validation_error")
    problem(owner_api.post(f"{API}/appeals", {"node": "junk", "statement": "x"}), 400, "invalid_filter")
    appeal = owner_api.post(f"{API}/appeals", {"node": str(node.pk), "statement": "It was a disk error."})
    assert appeal.status_code == 201
    problem(owner_api.post(f"{API}/appeals", {"node": str(node.pk), "statement": "again"}), 409, "appeal_already_open")
    problem(operator_api.post(f"{API}/appeals", {"node": str(node.pk), "statement": "x"}), 403, "forbidden")

    queue = operator_api.get(f"{API}/appeals?state=open").json()["results"]
    assert [a["statement"] for a in queue] == ["It was a disk error."]
    url = f"{API}/appeals/{queue[0]['id']}/resolve"
    problem(
        operator_api.post(url, {"outcome": "maybe", "resolution": "x"}, HTTP_IF_MATCH='"1"'), 400, "invalid_outcome"
    )
    problem(owner_api.post(url, {"outcome": "overturned", "resolution": "x"}, HTTP_IF_MATCH='"1"'), 403, "forbidden")
    resolved = operator_api.post(
        url, {"outcome": "overturned", "resolution": "Disk replaced; released."}, HTTP_IF_MATCH='"1"'
    )
    assert resolved.status_code == 200 and resolved.json()["state"] == "overturned"
    node.refresh_from_db()
    assert node.lifecycle == "pending"  # released: admission again
    status = owner_api.get(f"{API}/nodes/{node.pk}/quarantine-status").json()
    assert (status["open"], status["can_appeal"], status["appeals"][0]["resolution"]) == (
        False,
        False,
        "Disk replaced; released.",
    )
    problem(
        operator_api.post(url, {"outcome": "upheld", "resolution": "x"}, HTTP_IF_MATCH='"2"'), 409, "appeal_not_open"
    )


def test_appealing_a_node_that_is_not_quarantined_or_not_yours(owner_api, node, other_owner, pool):
    problem(owner_api.post(f"{API}/appeals", {"node": str(node.pk), "statement": "x"}), 409, "node_not_quarantined")
    theirs = owned_node(pool, other_owner, "theirs")[0]
    maintenance.quarantine_node(node_id=theirs.pk, reason="r", evidence={}, actor=OPERATOR)
    problem(owner_api.post(f"{API}/appeals", {"node": str(theirs.pk), "statement": "x"}), 404, "node_not_found")
    assert not Appeal.objects.exists()


def test_an_owner_withdraws_their_appeal(owner_api, node):
    maintenance.quarantine_node(node_id=node.pk, reason="r", evidence={}, actor=OPERATOR)
    appeal = owner_api.post(f"{API}/appeals", {"node": str(node.pk), "statement": "mine"}).json()
    assert owner_api.post(f"{API}/appeals/{appeal['id']}/withdraw").json()["state"] == "withdrawn"
    problem(owner_api.post(f"{API}/appeals/{appeal['id']}/withdraw"), 409, "appeal_not_open")
    problem(owner_api.get(f"{API}/appeals/999999"), 404, "appeal_not_found")


def test_guidance_is_read_by_owners_and_written_by_operators(owner_api, operator_api):
    assert "appeal" in owner_api.get(f"{API}/quarantine-guidance").json()["agent_version_not_allowed"]
    url = f"{API}/quarantine-guidance/manual"
    problem(owner_api.put(url, {"next_steps": "x"}), 403, "forbidden")
    problem(operator_api.put(url, {"next_steps": ""}), 400, "validation_error")
    problem(operator_api.put(f"{API}/quarantine-guidance/nope", {"next_steps": "x"}), 404, "rule_not_found")
    assert operator_api.put(url, {"next_steps": "Call us."}).json() == {"rule": "manual", "next_steps": "Call us."}
    assert owner_api.get(url).json()["next_steps"] == "Call us."


def test_owned_leases_show_the_owners_running_work_without_client_fields(owner_api, node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-live", node=node)
    with time_machine.travel(at(0) + timedelta(seconds=1), tick=False):
        rows = owner_api.get(f"{API}/owned-leases?node={node.pk}").json()["results"]
    assert [r["id"] for r in rows] == [str(lease.pk)]
    assert "command" not in rows[0] and "client" not in rows[0]
    assert Node.objects.get(pk=node.pk).owner is not None
