"""The payouts import reads the export back (JSON or CSV): paid with the external reference, or
failed with a reason; a re-import is idempotent; bad input is a 4xx problem+json with a stable code
and stores nothing (docs/marketplace.md, "Export and import")."""

from __future__ import annotations

import csv
import io

import pytest
from django.contrib.auth.models import User

from fleet.events import Actor
from fleet.models import NodeEvent
from marketplace import payouts
from marketplace.models import Payout, PayoutHold
from tests.marketplace.test_marketplace_money_api import (  # noqa: F401  (fixtures)
    API,
    NEXT,
    final_statement,
    reconcile_and_finalize,
    second_operator_api,
)
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db
IMPORT = f"{API}/payouts/import"


@pytest.fixture
def approved(final_statement, operator, second_operator_api):  # noqa: F811
    """oscar's 2.42 EUR payout, requested by one operator and approved by another."""
    statement, period, _ = final_statement
    reconcile_and_finalize(statement, period)
    payout = payouts.payout_request(
        statement_id=statement.pk, currency="EUR", actor=Actor("user", operator.username, user=operator), now=NEXT
    )
    approver = User.objects.get(username="paula-operator")
    return payouts.payout_approve(
        payout_id=payout.pk, expected_version=1, actor=Actor("user", approver.username, user=approver), now=NEXT
    )


def stored():
    return (
        list(Payout.objects.values_list("state", "external_reference", "failure_reason", "version")),
        NodeEvent.objects.filter(subject_type="payout").count(),
    )


def refused(response, status, code, before):
    assert_problem(response, status, code)
    assert stored() == before, "a refused import stored nothing"
    return response.json()


def exported(api, kind="json"):
    answer = api.get(f"{API}/payouts/export.{kind}")
    assert answer.status_code == 200
    return answer.json()["payouts"] if kind == "json" else answer.content.decode()


def test_the_json_export_marked_paid_imports_once_and_again_changes_nothing(approved, operator_api):
    rows = exported(operator_api)
    assert [r["state"] for r in rows] == ["approved"]
    rows[0].update(state="paid", external_reference="SEPA-2026-11-0042")
    answer = operator_api.post(IMPORT, {"payouts": rows}, format="json")
    assert answer.status_code == 200, answer.content
    assert answer.json() == {"applied": 1, "unchanged": 0,
                             "results": [{"row": 1, "id": rows[0]["id"], "outcome": "paid"}]}  # fmt: skip
    payout = Payout.objects.get()
    assert (payout.state, payout.external_reference, payout.version) == ("paid", "SEPA-2026-11-0042", 3)
    events = NodeEvent.objects.filter(subject_type="payout").count()
    # The same file again: nothing changes, no event.
    again = operator_api.post(IMPORT, {"payouts": rows}, format="json")
    assert again.json()["unchanged"] == 1 and again.json()["applied"] == 0
    assert NodeEvent.objects.filter(subject_type="payout").count() == events
    assert Payout.objects.get().version == 3
    # And the export it makes now re-imports unchanged too.
    assert operator_api.post(IMPORT, {"payouts": exported(operator_api)}, format="json").json()["unchanged"] == 1


def test_the_csv_export_marked_failed_imports(approved, operator_api):
    text = exported(operator_api, "csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    rows[0].update(state="failed", failure_reason="IBAN closed")
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    answer = operator_api.generic("POST", IMPORT, out.getvalue().encode(), content_type="text/csv")
    assert answer.status_code == 200, answer.content
    assert answer.json()["applied"] == 1
    assert Payout.objects.get().state == "failed" and Payout.objects.get().failure_reason == "IBAN closed"
    again = operator_api.generic("POST", IMPORT, out.getvalue().encode(), content_type="text/csv")
    assert again.json()["unchanged"] == 1


def test_malformed_imports_are_400_and_store_nothing(approved, operator_api):
    good = exported(operator_api)[0]
    before = stored()
    refused(operator_api.post(IMPORT, {"payouts": "all"}, format="json"), 400, "payout_import_invalid", before)
    refused(operator_api.post(IMPORT, {"payouts": []}, format="json"), 400, "payout_import_invalid", before)
    refused(operator_api.post(IMPORT, {"rows": [good]}, format="json"), 400, "unknown_field", before)
    cases = [
        ({**good, "state": "paid"}, "external_reference"),  # paid without the reference
        ({**good, "state": "failed"}, "failure_reason"),
        ({**good, "state": "settled"}, "state"),
        ({**good, "id": "not-a-uuid"}, "id"),
        ({**good, "state": "paid", "external_reference": "X", "amount": 2.42}, "amount"),  # a JSON number
        ({**good, "state": "paid", "external_reference": "X", "amount": "NaN"}, "amount"),
        ({**good, "state": "paid", "external_reference": "X", "amount": "Infinity"}, "amount"),
        ({**good, "iban": "DE00"}, "iban"),
        ("a row", ""),
    ]
    for row, field in cases:
        body = refused(operator_api.post(IMPORT, {"payouts": [row]}, format="json"), 400, "payout_import_invalid",
                       before)  # fmt: skip
        assert field in [e["field"] for e in body["errors"]], (row, body)
    paid = {**good, "state": "paid", "external_reference": "X"}
    body = refused(operator_api.post(IMPORT, {"payouts": [paid, paid]}, format="json"), 400,
                   "payout_import_invalid", before)  # fmt: skip
    assert body["errors"] == [
        {"row": 2, "field": "id", "code": "invalid", "message": "this payout is in the import twice"}
    ]
    ragged = "id,state\n" + f"{good['id']},paid,extra\n"
    refused(operator_api.generic("POST", IMPORT, ragged.encode(), content_type="text/csv"), 400,
            "payout_import_invalid", before)  # fmt: skip


def test_rows_that_contradict_the_payouts_are_409_and_nothing_is_stored(approved, operator_api):
    good = exported(operator_api)[0]
    paid = {**good, "state": "paid", "external_reference": "SEPA-1"}
    before = stored()
    unknown = {**paid, "id": "00000000-0000-4000-8000-000000000000"}
    # One good row and one unknown: all or nothing.
    body = refused(operator_api.post(IMPORT, {"payouts": [paid, unknown]}, format="json"), 409,
                   "payout_import_conflict", before)  # fmt: skip
    assert [(r["row"], r["code"]) for r in body["rows"]] == [(2, "payout_not_found")]
    for row, code in (
        ({**paid, "amount": "2.43"}, "amount_differs"),
        ({**paid, "currency": "USD"}, "currency_differs"),
        ({**good, "state": "reversed"}, "transition_not_allowed"),
        ({**good, "state": "requested"}, "transition_not_allowed"),
    ):
        body = refused(operator_api.post(IMPORT, {"payouts": [row]}, format="json"), 409, "payout_import_conflict",
                       before)  # fmt: skip
        assert [r["code"] for r in body["rows"]] == [code]
    # A hold placed after the approval: the import may not pay it.
    hold = PayoutHold.objects.create(statement_id=good["statement"], reason="outlier", message="m", created_at=NEXT)
    body = refused(operator_api.post(IMPORT, {"payouts": [paid]}, format="json"), 409, "payout_import_conflict",
                   before)  # fmt: skip
    assert [r["code"] for r in body["rows"]] == ["statement_on_hold"]
    hold.delete()
    assert operator_api.post(IMPORT, {"payouts": [paid]}, format="json").status_code == 200
    # Paid already, with another reference: refused, the stored reference stands.
    before = stored()
    other = {**paid, "external_reference": "SEPA-2"}
    body = refused(operator_api.post(IMPORT, {"payouts": [other]}, format="json"), 409, "payout_import_conflict",
                   before)  # fmt: skip
    assert [r["code"] for r in body["rows"]] == ["reference_differs"]


def test_only_operators_import(approved, owner_api, operator_api):
    rows = exported(operator_api)
    before = stored()
    refused(owner_api.post(IMPORT, {"payouts": rows}, format="json"), 403, "forbidden", before)
