"""The money API: pool periods, payouts, holds and line appeals; bad input is a 4xx problem+json
with a stable code and stores nothing (docs/marketplace.md, "Payouts")."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine

from fleet.events import Actor
from fleet.models import NodeEvent
from marketplace import periods, statements
from marketplace.models import LineAppeal, Payout, PoolPeriod, Statement
from tests.marketplace_support import owned_node, priced_pool
from tests.money_support import daily, offered, settled_usage
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db
API = "/api/v1"
DAY = datetime(2026, 11, 2, tzinfo=UTC)
NEXT = DAY + timedelta(days=1, hours=1)


@pytest.fixture
def final_statement(owner, client_user):
    """oscar's statement of 2 November: one 2-hour line (2.42 EUR), final, its pool period reconciled."""
    pool = priced_pool()
    daily(pool, owner)
    node = owned_node(pool, owner, "m")[0]
    offered(node, DAY, DAY + timedelta(hours=12))
    record = settled_usage(client_user, pool, node, DAY + timedelta(hours=1), DAY + timedelta(hours=3))
    period = periods.period_for(pool, DAY + timedelta(hours=1))
    statement = Statement.objects.get(owner=owner)
    return statement, period, record.statement_line


def reconcile_and_finalize(statement, period):
    periods.reconcile_period(period_id=period.pk, actor=Actor.system("t"), now=NEXT)
    return statements.finalize_statement(
        statement_id=statement.pk, expected_version=1, actor=Actor.system("t"), now=NEXT
    )


def stored():
    return (Payout.objects.count(), LineAppeal.objects.count(), NodeEvent.objects.filter(type="statement").count())


def refused(response, status, code, before):
    assert_problem(response, status, code)
    assert stored() == before, "a refused request stored nothing"


@pytest.fixture
def second_operator_api(db):
    from django.contrib.auth.models import Group, User

    from nodepool.api.permissions import OPERATORS
    from tests.conftest import _api

    user = User.objects.create_user(username="paula-operator", password="pw")
    user.groups.add(Group.objects.get_or_create(name=OPERATORS)[0])
    return _api(user)


def test_a_payout_needs_a_final_statement_and_reconciled_periods(final_statement, operator_api):
    statement, period, _ = final_statement
    before = stored()
    body = {"statement": statement.pk, "currency": "EUR"}
    refused(operator_api.post(f"{API}/payouts", body, format="json"), 409, "statement_not_final", before)
    with time_machine.travel(NEXT, tick=False):
        statements.finalize_statement(statement_id=statement.pk, expected_version=1, actor=Actor.system("t"), now=NEXT)
    before = stored()
    answer = operator_api.post(f"{API}/payouts", body, format="json")
    refused(answer, 409, "period_not_reconciled", before)
    assert answer.json()["periods"][0]["state"] == "pending"


def test_the_payout_lifecycle_through_the_api(final_statement, operator_api, second_operator_api, owner_api):
    statement, period, line = final_statement
    reconcile_and_finalize(statement, period)
    body = {"statement": statement.pk, "currency": "EUR"}
    created = operator_api.post(f"{API}/payouts", body, format="json")
    assert created.status_code == 201, created.content
    payout = created.json()
    assert (payout["amount"], payout["state"]) == ("2.42", "requested")
    before = stored()
    refused(operator_api.post(f"{API}/payouts", body, format="json"), 409, "payout_exists", before)
    url = f"{API}/payouts/{payout['pk']}"
    refused(operator_api.post(f"{url}/approve", HTTP_IF_MATCH='"1"'), 403, "approval_by_requester", before)
    refused(second_operator_api.post(f"{url}/approve"), 428, "version_required", before)
    approved = second_operator_api.post(f"{url}/approve", HTTP_IF_MATCH='"1"')
    assert approved.json()["state"] == "approved"
    before = stored()
    refused(operator_api.post(f"{url}/paid", {}, format="json", HTTP_IF_MATCH='"2"'), 400, "validation_error", before)
    paid = operator_api.post(f"{url}/paid", {"external_reference": "SEPA-77"}, format="json", HTTP_IF_MATCH='"2"')
    assert (paid.json()["state"], paid.json()["external_reference"]) == ("paid", "SEPA-77")
    # The owner sees it; the line of a paid statement can no longer be appealed.
    assert [p["id"] for p in owner_api.get(f"{API}/payouts").json()["results"]] == [payout["id"]]
    before = stored()
    refused(owner_api.post(f"{API}/line-appeals", {"line": line.pk, "message": "too low"}, format="json"), 409,
            "line_paid", before)  # fmt: skip
    exported = operator_api.get(f"{API}/payouts/export.json").json()["payouts"]
    assert [(p["id"], p["amount"], p["state"]) for p in exported] == [(payout["id"], "2.42", "paid")]
    csv_rows = operator_api.get(f"{API}/payouts/export.csv").content.decode().splitlines()
    assert csv_rows[0].startswith("id,statement,owner") and csv_rows[1].startswith(payout["id"])


def test_line_appeals_refuse_other_owners_lines_twice_and_float_amounts(
    final_statement, operator_api, owner_api, other_owner
):
    statement, period, line = final_statement
    from tests.conftest import _api

    before = stored()
    open_line = owner_api.post(f"{API}/line-appeals", {"line": line.pk, "message": "x"}, format="json")
    refused(open_line, 409, "statement_not_final", before)
    reconcile_and_finalize(statement, period)
    before = stored()
    refused(_api(other_owner).post(f"{API}/line-appeals", {"line": line.pk, "message": "mine"}, format="json"), 404,
            "line_not_found", before)  # fmt: skip
    filed = owner_api.post(f"{API}/line-appeals", {"line": line.pk, "message": "ran longer"}, format="json")
    assert filed.status_code == 201, filed.content
    before = stored()
    refused(owner_api.post(f"{API}/line-appeals", {"line": line.pk, "message": "again"}, format="json"), 409,
            "line_appeal_exists", before)  # fmt: skip
    url = f"{API}/line-appeals/{filed.json()['id']}/resolve"
    for amount in (0.61, "NaN", "Infinity", "0.615", "1e3x"):
        body = {"outcome": "corrected", "resolution": "ok", "amount": amount}
        refused(operator_api.post(url, body, format="json", HTTP_IF_MATCH='"1"'), 400, "invalid_decimal", before)
    refused(operator_api.post(url, {"outcome": "maybe", "resolution": "ok"}, format="json", HTTP_IF_MATCH='"1"'),
            400, "invalid_outcome", before)  # fmt: skip
    refused(operator_api.post(url, {"outcome": "rejected", "resolution": "ok", "extra": 1}, format="json",
                              HTTP_IF_MATCH='"1"'), 400, "unknown_field", before)  # fmt: skip
    resolved = operator_api.post(
        url, {"outcome": "corrected", "resolution": "found", "amount": "-0.20"}, format="json", HTTP_IF_MATCH='"1"'
    )
    assert resolved.json()["state"] == "corrected" and resolved.json()["correction_amount"] == "-0.20"
    assert owner_api.get(f"{API}/line-appeals").json()["results"][0]["state"] == "corrected"


def test_resolving_a_line_appeal_locks_the_appeal_row_only_not_its_line_or_statement(final_statement, owner):
    """The appeal is locked (its version and its move); the line and its final statement, joined by
    select_related, are only read. Without ``of=("self",)`` PostgreSQL locked both FOR UPDATE too,
    so a payout request on the statement, and any insert naming the line or the statement (FOR KEY
    SHARE), waited for the resolution."""
    import re

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from marketplace import line_appeals

    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises every writing transaction")
    statement, period, line = final_statement
    reconcile_and_finalize(statement, period)
    appeal = line_appeals.line_appeal_create(
        owner=owner, line_id=line.pk, message="ran longer", actor=Actor.system("o")
    )
    with CaptureQueriesContext(connection) as queries:
        line_appeals.line_appeal_resolve(
            appeal_id=appeal.pk, outcome="corrected", resolution="found", amount=Decimal("0.61"),
            expected_version=appeal.version, actor=Actor.system("t"),
        )  # fmt: skip
    locks = [q["sql"] for q in queries.captured_queries if re.search(r"FOR (NO KEY )?UPDATE", q["sql"])]
    appeal_locks = [sql for sql in locks if 'FROM "marketplace_lineappeal"' in sql]
    assert appeal_locks and all(sql.endswith('FOR UPDATE OF "marketplace_lineappeal"') for sql in appeal_locks)
    assert LineAppeal.objects.get(pk=appeal.pk).state == "corrected"


def test_pool_periods_and_mismatch_items_in_the_api(final_statement, operator_api, owner_api):
    statement, period, _ = final_statement
    with time_machine.travel(DAY + timedelta(hours=5), tick=False):
        assert_problem(operator_api.post(f"{API}/pool-periods/{period.pk}/reconcile"), 409, "period_not_over")
    with time_machine.travel(NEXT, tick=False):
        reconciled = operator_api.post(f"{API}/pool-periods/{period.pk}/reconcile").json()
    assert (
        reconciled["state"] == "reconciled" and reconciled["money"]["offered"] == "61.44"
    )  # 12 h x (8 x 0.60 + 32 x 0.01)
    mine = owner_api.get(f"{API}/pool-periods").json()["results"]
    assert [p["id"] for p in mine] == [period.pk] and "offered" not in mine[0]
    assert_problem(operator_api.get(f"{API}/pool-periods?state=closed"), 400, "invalid_filter")
    assert PoolPeriod.objects.get(pk=period.pk).state == "reconciled"


def test_pool_period_settings_through_the_settlement_endpoint(operator_api):
    from marketplace.models import PoolSettlement

    pool = priced_pool("settled")
    url = f"{API}/pools/{pool.name}/settlement"
    answer = operator_api.put(url, {"period": "week", "idle_paid": True, "hold_multiple": "5"}, format="json")
    assert answer.status_code == 200, answer.content
    assert (answer.json()["period"], answer.json()["idle_paid"], answer.json()["hold_multiple"]) == (
        "week",
        True,
        "5.00",
    )
    bad = [
        ({"period": "year"}, "validation_error"),
        ({"hold_multiple": 5.0}, "invalid_decimal"),
        ({"hold_multiple": "0.5"}, "invalid_decimal"),
        ({"idle_paid": "yes"}, "validation_error"),
    ]
    for body, code in bad:
        assert_problem(operator_api.put(url, body, format="json"), 400, code)
    assert PoolSettlement.objects.get(pool=pool).period == "week"
