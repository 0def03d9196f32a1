"""Races: two reconcilers, two finalizers, two appeals at once (run on PostgreSQL in CI, and SQLite)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from fleet.events import Actor
from fleet.models import NodeEvent
from leases.fencing import lease_release
from maintenance import services as maintenance
from marketplace import appeals, statements
from marketplace import event_types as marketplace_events
from marketplace.choices import UsageState
from marketplace.models import Appeal, Statement, UsageRecord
from marketplace.reconciliation import reconcile_usage
from tests.marketplace_support import ACTOR, Reporter, at, grant_at, owned_node, priced_pool
from tests.races import Hold, race

pytestmark = [pytest.mark.race, pytest.mark.django_db(transaction=True)]
THREADS = 4


def ended_lease(owner, client_user):
    pool = priced_pool()
    node = owned_node(pool, owner, "r")[0]
    lease = grant_at(0, client_user, pool, "race-job", node=node)
    Reporter(node).every(10, 60, [lease])
    with time_machine.travel(at(65), tick=False):
        lease_release(
            lease_id=lease.pk,
            data={"fencing_token": lease.fencing_token, "node_incarnation": 1},
            user=client_user,
            actor=ACTOR,
        )
    return node, UsageRecord.objects.get(lease=lease)


def test_two_reconcilers_at_once_give_one_outcome_and_one_event(owner, client_user):
    _, record = ended_lease(owner, client_user)
    later = record.settle_after + timedelta(seconds=1)
    # Every racer is held inside the section, after the row lock, before the write it decides.
    with Hold("marketplace.reconciliation.evaluate", parties=THREADS) as hold:
        outcome = race(lambda i: reconcile_usage(record.pk, actor=Actor.system(f"r{i}"), now=later), THREADS)
    assert not outcome.errors, outcome.errors
    assert {r.state for r in outcome.results} == {UsageState.RECONCILED}
    assert hold.max_inside == 1
    record.refresh_from_db()
    assert (record.state, record.version) == (UsageState.RECONCILED, 2)
    assert NodeEvent.objects.filter(type=marketplace_events.USAGE, subject_id=str(record.pk)).count() == 1


def test_two_operators_finalizing_one_statement_at_once_finalize_it_once(owner, client_user):
    _, record = ended_lease(owner, client_user)
    reconcile_usage(record.pk, actor=ACTOR, now=record.settle_after)
    statement = Statement.objects.get(owner=owner)
    after = statement.period_end + timedelta(hours=1)

    def finalize(i):
        try:
            return statements.finalize_statement(
                statement_id=statement.pk, expected_version=statement.version, actor=Actor.system(f"f{i}"), now=after
            ).state
        except Exception as exc:
            return exc.get_codes() if hasattr(exc, "get_codes") else repr(exc)

    with Hold("marketplace.statements.check_version", parties=THREADS) as hold:
        outcome = race(finalize, THREADS)
    assert not outcome.errors
    assert outcome.count("final") == 1
    assert set(outcome.results) - {"final"} <= {"version_mismatch", "statement_final"}
    assert hold.max_inside == 1
    assert NodeEvent.objects.filter(type=marketplace_events.STATEMENT, subject_id=str(statement.pk)).count() == 1


def test_two_appeals_of_one_quarantine_at_once_open_one(owner, client_user):
    node, _ = ended_lease(owner, client_user)
    maintenance.quarantine_node(node_id=node.pk, reason="odd", evidence={}, actor=ACTOR)

    def appeal(i):
        try:
            return appeals.appeal_create(owner=owner, node_id=node.pk, statement=f"mine {i}", actor=ACTOR).state
        except Exception as exc:
            return exc.get_codes() if hasattr(exc, "get_codes") else repr(exc)

    # Decided by the partial unique constraint (one open appeal per quarantine), not a row lock.
    outcome = race(appeal, THREADS)
    assert not outcome.errors
    assert outcome.count("open") == 1
    assert set(outcome.results) - {"open"} == {"appeal_already_open"}
    assert Appeal.objects.filter(node=node).count() == 1
