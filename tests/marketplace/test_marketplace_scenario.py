"""The done-when scenario: a simulated fleet of one owner's nodes — normal work, a silent period, a
restart, a quarantined node, a dispute — produces statements whose totals equal the hand-computed ones.

Prices (pool "market", EUR): cpu 0.60 per core-hour, memory 0.01 per GiB-hour. Every lease holds
2 cpu + 1 GiB, so one evidenced hour is 2 x 0.60 + 1 x 0.01 = 1.21 EUR; a line is rounded to cents.

| node | story | evidenced | line |
|---|---|---|---|
| normal | reports every 30 s from 30 to 3630 | 3600 s | 1.21 |
| silent | 30..1800, silent 120 s (> 40 s grace), 1920..3630 | 1770 + 1710 = 3480 s | 1.169666… → 1.17 |
| restart | 30..1800, new incarnation at 1830 adopts it, 1830..3630 | 1770 + 1800 = 3570 s | 1.199916… → 1.20 |
| quarantined | 30..1800, quarantined at 1815 (lease revoked) | 1770 s | held → carried |
| dispute | 30..630 reporting no cpu and no memory use | 600 s | disputed → carried |

November: 1.21 + 1.17 + 1.20 = 3.58 EUR, final on 1 December with two lines carried to December.
December: the quarantine is released (the held line reconciles: 1770 s → 0.594916… → 0.59) and an
operator accepts the disputed 600 s (0.201666… → 0.20): 0.79 EUR.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine

from fleet.events import Actor
from leases.fencing import lease_release
from maintenance import services as maintenance
from marketplace import statements
from marketplace.choices import StatementState, UsageState
from marketplace.models import Statement, StatementLine, UsageRecord
from marketplace.reconciliation import reconcile_due, resolve_usage
from nodepool.api.problems import Conflict
from tests.marketplace_support import ACTOR, Reporter, at, grant_at, owned_node, priced_pool

pytestmark = pytest.mark.django_db
OPERATOR = Actor.system("operator-test")
DEC_1 = datetime(2026, 12, 1, tzinfo=UTC)
JAN_1 = datetime(2027, 1, 1, tzinfo=UTC)


def release(seconds, lease, client_user, incarnation=1):
    with time_machine.travel(at(seconds), tick=False):
        lease_release(
            lease_id=lease.pk,
            data={"fencing_token": lease.fencing_token, "node_incarnation": incarnation, "outcome": "succeeded"},
            user=client_user,
            actor=ACTOR,
        )


@pytest.fixture
def fleet(owner, client_user):
    pool = priced_pool()
    nodes = {
        name: owned_node(pool, owner, name)[0] for name in ("normal", "silent", "restart", "quarantined", "dispute")
    }
    leases = {name: grant_at(0, client_user, pool, f"job-{name}", node=node) for name, node in nodes.items()}
    reporters = {name: Reporter(node) for name, node in nodes.items()}

    def every(name, start, end, **kwargs):
        reporters[name].every(start, end, [leases[name]], step=30, **kwargs)

    every("normal", 30, 3630)
    every("silent", 30, 1800)
    every("silent", 1920, 3630)
    every("restart", 30, 1800)
    every("restart", 1830, 3630, incarnation=2)
    every("quarantined", 30, 1800)
    every("dispute", 30, 630, usage={"cpu": 0, "memory": 0})
    with time_machine.travel(at(1815), tick=False):
        maintenance.quarantine_node(
            node_id=nodes["quarantined"].pk, reason="integrity alarm", evidence={"hash": "bad"}, actor=OPERATOR
        )
    release(640, leases["dispute"], client_user)
    for name in ("normal", "silent"):
        release(3635, leases[name], client_user)
    release(3635, leases["restart"], client_user, incarnation=2)
    return {"pool": pool, "nodes": nodes, "leases": leases}


def record(fleet, name):
    return UsageRecord.objects.get(lease=fleet["leases"][name])


def test_the_simulated_fleet_produces_the_hand_computed_statements(fleet, owner):
    # The settlement window (15 min) passes; the beat sweep reconciles everything due.
    assert reconcile_due(actor=ACTOR, now=at(3635 + 901)) == {"reconciled": 3, "held": 1, "disputed": 1}
    billable = {name: record(fleet, name).billable_seconds for name in fleet["leases"]}
    assert billable == {
        "normal": Decimal(3600),
        "silent": Decimal(3480),
        "restart": Decimal(3570),
        "quarantined": Decimal(1770),
        "dispute": Decimal(600),
    }
    november = Statement.objects.get(owner=owner)
    assert statements.totals(november) == {"EUR": "3.58"}

    # Finalizing before the month is over is refused; on 1 December it carries the two open lines.
    with pytest.raises(Conflict) as early:
        statements.finalize_statement(statement_id=november.pk, expected_version=1, actor=OPERATOR, now=at(4000))
    assert early.value.get_codes() == "period_not_over"
    november = statements.finalize_statement(
        statement_id=november.pk, expected_version=1, actor=OPERATOR, now=DEC_1 + timedelta(hours=1)
    )
    assert (november.state, november.totals) == (StatementState.FINAL, {"EUR": "3.58"})
    assert sorted(line.state for line in november.lines.all()) == ["reconciled"] * 3
    assert sorted(c["state"] for c in november.carried_out) == ["disputed", "held"]
    december = Statement.objects.get(owner=owner, period_start=DEC_1)
    assert {line.carried_from_id for line in december.lines.all()} == {november.pk}
    check_exports(november, "3.58", lines=3)
    check_immutable(november)

    # A final statement never holds a held or disputed line: they moved on, with their reason.
    assert not StatementLine.objects.filter(statement__state="final").exclude(state__in=["reconciled", "adjusted"])
    assert all(line.reason for line in december.lines.all())

    # December: the quarantine is released and the dispute resolved.
    node = fleet["nodes"]["quarantined"]
    node.refresh_from_db()
    with time_machine.travel(DEC_1 + timedelta(days=2), tick=False):
        maintenance.release_node(node_id=node.pk, expected_version=node.version, reason="false alarm", actor=OPERATOR)
    assert reconcile_due(actor=ACTOR, now=DEC_1 + timedelta(days=2, seconds=1)) == {"reconciled": 1}
    disputed = record(fleet, "dispute")
    resolve_usage(
        record_id=disputed.pk,
        decision="accept",
        expected_version=disputed.version,
        reason="logs show work",
        actor=OPERATOR,
    )
    assert statements.totals(december) == {"EUR": "0.79"}
    december = statements.finalize_statement(
        statement_id=december.pk, expected_version=december.version, actor=OPERATOR, now=JAN_1
    )
    assert (december.state, december.totals, december.carried_out) == (StatementState.FINAL, {"EUR": "0.79"}, [])


def test_a_statement_with_lines_inside_their_settlement_window_is_not_final(owner, client_user):
    pool = priced_pool()
    node = owned_node(pool, owner, "one")[0]
    lease = grant_at(0, client_user, pool, "job-pending", node=node)
    Reporter(node).every(10, 30, [lease])
    release(35, lease, client_user)
    november = Statement.objects.get(owner=owner)
    with pytest.raises(Conflict) as refused:
        statements.finalize_statement(
            statement_id=november.pk, expected_version=1, actor=OPERATOR, now=DEC_1 + timedelta(hours=1)
        )
    assert refused.value.get_codes() == "statement_has_unreconciled_lines"
    assert refused.value.extra["pending"] == 1
    assert UsageRecord.objects.get(lease=lease).state == UsageState.PENDING
    assert Statement.objects.get(pk=november.pk).state == StatementState.OPEN


def check_exports(statement, total: str, *, lines: int) -> None:
    """The CSV and JSON exports carry the same lines and totals as the statement."""
    import csv
    import io

    document = statements.export_json(statement)
    assert document["totals"] == {"EUR": total}
    assert sum(Decimal(line["amount"]) for line in document["lines"]) == Decimal(total)
    rows = list(csv.DictReader(io.StringIO(statements.export_csv(statement))))
    assert [r["amount"] for r in rows if r["usage_record"] == "total"] == [total]
    assert len([r for r in rows if r["usage_record"] != "total"]) == lines


def check_immutable(final) -> None:
    """A final statement refuses every change: saves, deletes, line edits, a second finalize."""
    from django.core.exceptions import ValidationError

    frozen = dict(final.totals)
    final.totals = {"EUR": "1000000.00"}
    with pytest.raises(ValidationError):
        final.save()
    line = final.lines.first()
    line.amount = Decimal("999")
    with pytest.raises(ValidationError):
        line.save()
    with pytest.raises(ValidationError):
        final.delete()
    with pytest.raises(Conflict) as again:
        statements.finalize_statement(statement_id=final.pk, expected_version=final.version, actor=OPERATOR, now=JAN_1)
    assert again.value.get_codes() == "statement_final"
    assert Statement.objects.get(pk=final.pk).totals == frozen
    assert not StatementLine.objects.filter(statement=final, amount=Decimal("999")).exists()
