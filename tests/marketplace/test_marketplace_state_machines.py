"""The marketplace's state machines (issue 28, step 6): every statement that moves a usage record,
a statement or an appeal is built from the declared transition (nodepool.fsm.move), and each
service's table of verbs agrees with the declaration it names."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from fleet.events import Actor
from marketplace import appeals, reconciliation, statements
from marketplace.choices import APPEAL_OUTCOMES, OPEN_STATES, AppealState, DisputeDecision, StatementState, UsageState
from marketplace.models import Appeal, Statement, UsageRecord
from nodepool import fsm
from tests.marketplace_support import owned_node, priced_pool
from tests.money_support import settled_usage

DAY = datetime(2026, 11, 2, tzinfo=UTC)
LATER = DAY + timedelta(days=62)
OPERATOR = Actor.system("o")


def test_reconciliation_moves_an_open_record_to_each_outcome_by_its_declared_verb():
    assert set(reconciliation.SETTLE) == set(UsageState.values) - {UsageState.PENDING}
    for outcome, verb in reconciliation.SETTLE.items():
        assert fsm.target(UsageRecord, verb) == outcome
        assert set(fsm.sources(UsageRecord, verb)) <= set(OPEN_STATES)
    # Held stays held without a move (only the holding quarantine may change).
    assert fsm.sources(UsageRecord, "hold") == (UsageState.PENDING,)


def test_an_operator_decides_only_a_disputed_or_held_record_by_its_declared_verb():
    assert set(reconciliation.DECIDE) == set(DisputeDecision.values)
    expected = {"accept": UsageState.RECONCILED, "adjust": UsageState.ADJUSTED, "reject": UsageState.ADJUSTED}
    for decision, verb in reconciliation.DECIDE.items():
        assert fsm.target(UsageRecord, verb) == expected[decision]
        assert set(fsm.sources(UsageRecord, verb)) == {UsageState.DISPUTED, UsageState.HELD}


def test_statements_and_appeals_move_by_their_declared_verbs():
    assert fsm.sources(Statement, "finalize") == (StatementState.OPEN,)
    assert fsm.target(Statement, "finalize") == StatementState.FINAL
    assert set(appeals.RESOLVE) == set(APPEAL_OUTCOMES)
    for outcome, verb in appeals.RESOLVE.items():
        assert fsm.sources(Appeal, verb) == (AppealState.OPEN,)
        assert fsm.target(Appeal, verb) == outcome
    assert fsm.sources(Appeal, "withdraw") == (AppealState.OPEN,)
    assert fsm.target(Appeal, "withdraw") == AppealState.WITHDRAWN


def _state_update(queries, table: str) -> str:
    """The one UPDATE of ``table`` that sets its state, as run."""
    found = [q["sql"] for q in queries if q["sql"].startswith(f'UPDATE "{table}"') and '"state" =' in q["sql"]]
    assert len(found) == 1, found
    return found[0]


def _in_list(values) -> str:
    return "IN (" + ", ".join(f"'{v}'" for v in values) + ")"


@pytest.mark.django_db
def test_the_services_statements_are_the_declared_ones(owner, client_user):
    pool = priced_pool()
    node = owned_node(pool, owner, "sm")[0]
    pending = settled_usage(client_user, pool, node, DAY, DAY + timedelta(hours=1), state=UsageState.PENDING)
    with CaptureQueriesContext(connection) as reconcile:
        record = reconciliation.reconcile_usage(pending.pk, actor=Actor.system("t"), now=LATER, force=True)
    sql = _state_update(reconcile.captured_queries, "marketplace_usagerecord")
    verb = reconciliation.SETTLE[record.state]
    assert _in_list(fsm.sources(UsageRecord, verb)) in sql
    assert f"\"state\" = '{fsm.target(UsageRecord, verb)}'" in sql

    disputed = settled_usage(client_user, pool, node, DAY + timedelta(hours=2), DAY + timedelta(hours=3),
                             state=UsageState.DISPUTED)  # fmt: skip
    with CaptureQueriesContext(connection) as decide:
        reconciliation.resolve_usage(
            record_id=disputed.pk, decision="accept", expected_version=disputed.version, reason="ok", actor=OPERATOR
        )
    sql = _state_update(decide.captured_queries, "marketplace_usagerecord")
    assert _in_list(fsm.sources(UsageRecord, "accept_dispute")) in sql
    assert UsageRecord.objects.get(pk=disputed.pk).state == UsageState.RECONCILED

    UsageRecord.objects.exclude(state__in=(UsageState.RECONCILED, UsageState.ADJUSTED)).update(
        state=UsageState.RECONCILED
    )
    statement = Statement.objects.get(owner=owner)
    with CaptureQueriesContext(connection) as finalize:
        statements.finalize_statement(
            statement_id=statement.pk, expected_version=statement.version, actor=OPERATOR, now=LATER
        )
    sql = _state_update(finalize.captured_queries, "marketplace_statement")
    assert _in_list(fsm.sources(Statement, "finalize")) in sql
    assert Statement.objects.get(pk=statement.pk).state == StatementState.FINAL
