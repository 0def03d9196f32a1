"""Lock order across apps on PostgreSQL: pool edits, clock gaps, preemption notices, statement
finalization and status reports against node actions, drains and grants; upgrade ticks and
scale-downs against the liveness sweep; node actions on two nodes of one pool, an admission
against an edit of its pool, an appeal overturned against its node's release (each test failed,
with a deadlock, a wait or a wrong state, before its fix); a reconciliation against the
finalization of its statement (pinned: record, then line, never the statement); and which rows the locking reads of
admissions, preemption notices and reconciliations lock (they locked the joined rows too)."""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from fleet import clock
from fleet.events import Actor
from fleet.models import ControlPlaneClock
from leases.models import Lease
from maintenance import drains
from maintenance import services as maintenance
from maintenance.models import Drain
from operations import outofservice
from tests.factories import make_schedulable_node
from tests.fleet.test_node_lock_order import _wait_until_another_transaction_waits_for_a_lock
from tests.maintenance_support import make_lease
from tests.races import race

pytestmark = [pytest.mark.race, pytest.mark.django_db(transaction=True)]


def _pg():
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's; SQLite serialises writers")


def _racer_0_waits_after(monkeypatch, module, name: str) -> threading.Event:
    """Wrap ``module.name`` so that racer 0, once it returns (holding what it locked), waits until
    the other racer waits for a lock. Returns the event set at that point, for the other racer."""
    inside, original = threading.Event(), getattr(module, name)

    def then_wait(*args, **kwargs):
        value = original(*args, **kwargs)
        if threading.current_thread().name == "racer-0":
            inside.set()
            _wait_until_another_transaction_waits_for_a_lock()
        return value

    monkeypatch.setattr(module, name, then_wait)
    return inside


def _race_a_finalization(monkeypatch, statement, now, other):
    """Racer 0 finalizes ``statement`` at ``now`` and, holding the statement row FOR UPDATE with its
    lines not read yet, waits until racer 1, running ``other()``, waits for a lock. The race's outcome."""
    from marketplace import statements
    from tests.marketplace_support import ACTOR

    inside = _racer_0_waits_after(monkeypatch, statements, "check_version")

    def racer(i):
        if i == 0:
            return statements.finalize_statement(
                statement_id=statement.pk, expected_version=statement.version, actor=ACTOR, now=now
            ).state
        assert inside.wait(10)
        return other()

    return race(racer, 2, timeout=30)


def _a_gap_is_pending(now, minutes=10):
    ControlPlaneClock.objects.update_or_create(pk=1, defaults={"observed_at": now - timedelta(minutes=minutes)})


def test_a_clock_gap_and_a_drain_evaluation_both_complete(monkeypatch):
    """observe() shifts every live lease, then every active drain; a drain evaluation locks its
    node, its drain, then the node's leases."""
    _pg()
    node, _ = make_schedulable_node()
    make_lease(node, "job-1", resources={"cpu": 500}, ttl=3600)
    drain = outofservice.take_out_of_service(
        node=node, owner=outofservice.AUTOSCALER, policy="wait", reason="scale-down", timeout=1800
    )
    now = timezone.now()
    _a_gap_is_pending(now)
    inside = _racer_0_waits_after(monkeypatch, drains, "_lock_drain")

    def racer(i):
        if i == 0:
            return drains.evaluate_drain(drain_id=drain.pk, actor=Actor.system("t"), now=now)
        assert inside.wait(10)
        return clock.observe(now=now)

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert outcome.results[1] is not None  # the gap was detected and paused


def test_an_earlier_preemption_notice_and_a_drain_requeueing_a_lease_both_complete(monkeypatch):
    """A second notice with a sooner deadline updates the Preemption row, then locks the node (to
    move the drain's deadline); a drain evaluation locks the node, revokes a lease, and its
    lease_ended receiver (requeue_evicted_lease) updates the same Preemption row."""
    _pg()
    from operations import preemption
    from operations.models import PoolOperations, Preemption
    from tests.conftest import CLIENTS, _user
    from tests.operations_support import ready_pool

    pool, nodes = ready_pool("spot", 1)
    PoolOperations.objects.create(pool=pool, spot=True)
    node = nodes[0][0]
    lease = make_lease(node, "job-1", resources={"cpu": 500}, ttl=3600)
    Lease.objects.filter(pk=lease.pk).update(client=_user("carla-client", CLIENTS))
    now = timezone.now()
    notice, _ = preemption.preemption_notice(
        node_id=node.pk, deadline=now + timedelta(seconds=600), source="agent", actor=Actor.system("t")
    )
    assert notice.drain_id is not None
    # The workload answered the drain's checkpoint request: the next evaluation revokes (and requeues) it.
    Lease.objects.filter(pk=lease.pk).update(checkpoint_requested_at=None, workload_state="checkpointed")
    inside = _racer_0_waits_after(monkeypatch, drains, "_lock_drain")

    def racer(i):
        if i == 0:
            return drains.evaluate_drain(drain_id=notice.drain_id, actor=Actor.system("t")).state
        assert inside.wait(10)
        return preemption.preemption_notice(
            node_id=node.pk, deadline=timezone.now() + timedelta(seconds=120), source="agent", actor=Actor.system("t")
        )[1]

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert Lease.objects.get(pk=lease.pk).state == "revoked"
    assert Preemption.objects.get(pk=notice.pk).leases_requeued == 1


def test_a_lease_ending_while_its_owners_statement_is_finalized_is_not_left_on_the_final_statement(
    owner, client_user, monkeypatch
):
    """finalize_statement locks the statement and reads its lines; a lease end meanwhile reads the
    statement (unlocked: still open) and inserts its line, which waits on the statement row (the
    foreign key's KEY SHARE) until the finalize commits, then lands on the final statement."""
    _pg()
    from leases.choices import LeaseState
    from leases.lifecycle import end_lease
    from marketplace.models import Statement, StatementLine, UsageRecord
    from marketplace.reconciliation import reconcile_usage
    from tests.marketplace.test_marketplace_races import ended_lease
    from tests.marketplace_support import ACTOR, grant_at

    node, record = ended_lease(owner, client_user)
    reconcile_usage(record.pk, actor=ACTOR, now=record.settle_after)
    other = grant_at(0, client_user, node.pool, "race-job-2", node=node)
    statement = Statement.objects.get(owner=owner)
    after = statement.period_end + timedelta(hours=1)
    # ended inside the period (a sweep's "now" from just before the period ended)
    ended_at = other.granted_at + timedelta(seconds=100)
    outcome = _race_a_finalization(
        monkeypatch,
        statement,
        after,
        lambda: end_lease(other.pk, to_state=LeaseState.REVOKED, actor=ACTOR, reason="t", now=ended_at).state,
    )
    assert outcome.errors == [], outcome.errors
    line = StatementLine.objects.select_related("statement").get(usage_record=UsageRecord.objects.get(lease=other))
    assert (line.statement.state, line.state) != ("final", "pending"), "a pending line on a final statement"


def test_a_drain_does_not_complete_between_a_status_reports_node_update_and_its_lease_stamps(monkeypatch):
    """An unchanged status report is the node row's UPDATE in autocommit (last_heartbeat_at), then
    the lease reconciliation in its own transaction (last_reported_at). A drain evaluated between
    the two sees a heartbeat after the lease ended and no stamp: "no longer reported", completes."""
    _pg()
    from leases import reconcile as lease_reconcile
    from tests.heartbeat_support import send

    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-1", resources={"cpu": 500}, ttl=3600)
    Lease.objects.filter(pk=lease.pk).update(command=["sleep", "600"])
    listed = [{"lease_id": str(lease.pk), "fencing_token": lease.fencing_token, "state": "running"}]
    send(node, 1, 1, leases=listed)
    drain = outofservice.take_out_of_service(
        node=node, owner=outofservice.AUTOSCALER, policy="wait", reason="scale-down", timeout=1800
    )
    lease_reconcile.revoke_lease(Lease.objects.get(pk=lease.pk), actor=Actor.system("t"), reason="done")
    assert drains.evaluate_drain(drain_id=drain.pk, actor=Actor.system("t")).state == "active"
    from fleet.models import Node

    Node.objects.filter(pk=node.pk).update(status_report_not_before=None)  # no flood guard in the way
    between, evaluated = threading.Event(), threading.Event()
    reconcile = lease_reconcile.reconcile_heartbeat

    def reconcile_after_the_drain(*args, **kwargs):
        between.set()  # the node row's UPDATE is committed; the lease stamps are not written yet
        evaluated.wait(5)
        return reconcile(*args, **kwargs)

    monkeypatch.setattr(lease_reconcile, "reconcile_heartbeat", reconcile_after_the_drain)

    def racer(i):
        if i == 0:
            return send(node, 2, 1, leases=listed).applied  # the node still runs the ended lease
        assert between.wait(10)
        try:
            return drains.evaluate_drain(drain_id=drain.pk, actor=Actor.system("t")).state
        finally:
            evaluated.set()

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert outcome.results[0] is True
    assert Lease.objects.get(pk=lease.pk).last_reported_at is not None  # the report listed it
    assert Drain.objects.get(pk=drain.pk).state == "active", "completed while the node still reports the lease"


def test_a_cordon_and_a_change_of_its_pools_labels_both_complete(monkeypatch):
    """pool_update locks the pool FOR UPDATE, then every node of the pool (a label or taint
    change); a node action locks its node, then writes an event whose pool foreign key takes FOR
    KEY SHARE on the pool row, which FOR UPDATE excludes."""
    _pg()
    from fleet.services import pool_update
    from maintenance import holds
    from tests.factories import PoolFactory

    pool = PoolFactory(name="general")
    node, _ = make_schedulable_node(pool)
    inside = _racer_0_waits_after(monkeypatch, holds, "_lock")

    def racer(i):
        if i == 0:
            return maintenance.cordon_node(
                node_id=node.pk, expected_version=node.version, reason="disk", actor=Actor.system("ops")
            ).cordoned
        assert inside.wait(10)
        return pool_update(
            pool_id=pool.pk, expected_version=pool.version, changes={"labels": {"zone": "b"}}, actor=Actor.system("t")
        ).labels

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert outcome.results == [True, {"zone": "b"}]


def test_a_grant_and_a_change_of_its_pools_reservations_both_complete(client_user, monkeypatch):
    """A grant holds its node, then updates the node's resource rows; pool_update recomputed every
    member's resource rows, then bumped the nodes' versions: the opposite order. It now locks the
    member nodes first."""
    _pg()
    from fleet.services import pool_update
    from leases import grant
    from leases import services as lease_services
    from tests.factories import PoolFactory

    pool = PoolFactory(name="general")
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    inside = _racer_0_waits_after(monkeypatch, grant, "_hold_schedulable_node")

    def racer(i):
        if i == 0:
            lease, status = lease_services.lease_create(
                data={"pool": "general", "workload_id": "job-1", "resources": {"cpu": "1"}},
                client=client_user,
                actor=Actor.system("t"),
            )
            return status
        assert inside.wait(10)
        return pool_update(
            pool_id=pool.pk, expected_version=pool.version, changes={"reservations": {"system": {"cpu": 500}}},
            actor=Actor.system("t"),
        ).version  # fmt: skip

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert outcome.results == [201, 2]


def test_an_upgrade_tick_taking_two_nodes_out_and_a_liveness_sweep_moving_both_complete(monkeypatch):
    """One upgrade tick takes several nodes out of service in one transaction, in the upgrade's
    order (node A, then B); the liveness sweep moves a pool's due nodes with one UPDATE per
    transition, unreachable before stale, in one transaction (B, then A). Two cycles, each a
    deadlock that cost the tick's step for B (or the whole sweep run, whichever waited first):

    * the sweep waited for A holding B while the tick waited for B holding A. The sweep now skips
      a node row another transaction holds (FOR NO KEY UPDATE SKIP LOCKED): A stays due and the
      next run moves it;
    * the tick held its pool row FOR UPDATE (lock_upgrade's select_related joined it into the
      lock), and the sweep's events for B take FOR KEY SHARE on that pool row at COMMIT (the
      deferred foreign key): the sweep waited for the tick holding B. The tick now locks only
      the upgrade row."""
    _pg()
    from fleet.liveness_sweep import sweep_liveness
    from fleet.models import Node
    from operations import rollout, upgrades
    from operations.choices import UpgradeNodeState
    from operations.models import PoolOperations, UpgradeNode
    from tests.operations_support import ready_pool

    monkeypatch.setattr("operations.upgrades.start_ticking", lambda upgrade: None)
    pool, members = ready_pool("general", 2)
    a, b = (node for node, _ in members)
    # Both nodes at once: the pool's budget must allow it (the default 10 % allows one).
    PoolOperations.objects.create(pool=pool, disruption_budgets=[{"nodes": "100%"}])
    upgrade = upgrades.upgrade_create(
        data={"pool": pool.name, "target": {"version": "2.0.0"}, "canary_nodes": 0, "max_unavailable_nodes": "2"},
        actor=Actor.system("t"),
    )
    upgrade = upgrades.upgrade_start(upgrade_id=upgrade.pk, expected_version=upgrade.version, actor=Actor.system("t"))
    order = list(UpgradeNode.objects.filter(upgrade=upgrade).order_by("position").values_list("node_id", flat=True))
    assert order == [a.pk, b.pk]
    now = timezone.now()
    # A missed two heartbeats (due for stale); B has been silent past the grace (due for unreachable).
    Node.objects.filter(pk=a.pk).update(last_heartbeat_at=now - timedelta(seconds=5),
                                        next_liveness_check_at=now - timedelta(seconds=1))  # fmt: skip
    Node.objects.filter(pk=b.pk).update(last_heartbeat_at=now - timedelta(seconds=45),
                                        next_liveness_check_at=now - timedelta(seconds=1))  # fmt: skip
    inside = _racer_0_waits_after(monkeypatch, outofservice, "take_out_of_service")

    def racer(i):
        if i == 0:
            return rollout.advance(upgrade_id=upgrade.pk, now=now)
        assert inside.wait(10)  # the tick holds A (cordoned, draining), B not reached yet
        return sweep_liveness(now=now)["moved"]

    outcome = race(racer, 2, timeout=60)
    assert outcome.errors == [], outcome.errors
    started = UpgradeNode.objects.filter(upgrade=upgrade).exclude(state=UpgradeNodeState.WAITING)
    assert started.count() == 2, "the tick's step for one node was the deadlock's victim"
    assert Node.objects.get(pk=b.pk).liveness == "unreachable"
    # A was held by the tick: skipped by that run, still due, moved by the next.
    sweep_liveness(now=now + timedelta(seconds=1))
    assert Node.objects.get(pk=a.pk).liveness == "stale"


def test_a_scale_down_and_a_liveness_sweep_moving_its_node_both_complete(monkeypatch):
    """scale_down locks its pool's operation settings, then takes an idle node out of service; it
    locked the joined pool row FOR UPDATE too (select_related), so a sweep that had moved that
    node waited at COMMIT for the pool row (its events' foreign key, FOR KEY SHARE) while
    scale_down waited for the node: a deadlock. The settings row is now locked alone."""
    _pg()
    from fleet.liveness_sweep import sweep_liveness
    from fleet.models import Node
    from operations import autoscaler
    from operations.models import PoolOperations, ProviderMachine
    from tests.operations_support import ready_pool

    pool, members = ready_pool("general", 2)
    PoolOperations.objects.create(pool=pool, provider="webhook", provider_url="http://127.0.0.1:9/scale",
                                  provider_secret="s", min_nodes=0, scale_down_after=0, scale_down_cooldown=0,
                                  drain_policy="terminate")  # fmt: skip
    now = timezone.now()
    for n, (node, _) in enumerate(members):
        ProviderMachine.objects.create(pool=pool, provider="webhook", name=f"m-{n}", node=node, state="ready",
                                       requested_at=now - timedelta(minutes=5 - n))  # fmt: skip
    first = members[0][0]
    # The machine scale-down picks first has been silent past the grace: the sweep moves it.
    Node.objects.filter(pk=first.pk).update(last_heartbeat_at=now - timedelta(seconds=45),
                                            next_liveness_check_at=now - timedelta(seconds=1))  # fmt: skip
    inside = _racer_0_waits_after(monkeypatch, autoscaler, "replaceable")

    def racer(i):
        if i == 0:
            return autoscaler.scale_down(pool_id=pool.pk, actor=Actor.system(outofservice.AUTOSCALER), now=now)
        assert inside.wait(10)  # scale-down holds its settings row, its node not locked yet
        return sweep_liveness(now=now)["moved"]

    outcome = race(racer, 2, timeout=60)
    assert outcome.errors == [], outcome.errors
    assert outcome.results[0] == 1
    assert ProviderMachine.objects.get(name="m-0").state == "draining"
    assert Node.objects.get(pk=first.pk).liveness == "unreachable"


def _racer_0_holds_after(monkeypatch, module, name: str, until: threading.Event, seconds: float = 5) -> threading.Event:
    """Wrap ``module.name`` so that racer 0, once it returns (holding what it locked), waits for
    ``until`` (set by the other racer when it is done), or ``seconds``. Returns the event set when
    racer 0 starts waiting, for the other racer."""
    inside, original = threading.Event(), getattr(module, name)

    def then_hold(*args, **kwargs):
        value = original(*args, **kwargs)
        if threading.current_thread().name == "racer-0":
            inside.set()
            until.wait(seconds)
        return value

    monkeypatch.setattr(module, name, then_hold)
    return inside


def test_node_actions_on_two_nodes_of_one_pool_do_not_wait_for_each_other(monkeypatch):
    """An operator's node action (_locked_node) locked its node and, joined by select_related,
    the node's pool row (FOR NO KEY UPDATE): a second action on another node of the pool waited
    for the first to commit. The node row is now locked alone (of=self)."""
    _pg()
    from fleet import services as fleet_services
    from tests.factories import NodeFactory, PoolFactory

    monkeypatch.setattr("fleet.tasks.run_admission.apply_async", lambda *args, **kwargs: None)
    pool = PoolFactory(name="general")
    a, b = NodeFactory(pool=pool), NodeFactory(pool=pool)
    done = threading.Event()
    inside = _racer_0_holds_after(monkeypatch, fleet_services, "check_version", until=done)

    def racer(i):
        if i == 0:
            fleet_services.node_credentials_revoke(node_id=a.pk, expected_version=a.version, actor=Actor.system("t"))
            return done.is_set()  # the other node's action finished while this one held its node
        assert inside.wait(10)
        try:
            admitted = fleet_services.node_admit(node_id=b.pk, expected_version=b.version, actor=Actor.system("t"))
            return admitted.lifecycle
        finally:
            done.set()

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert outcome.results == [True, "admitting"], "the second node's action waited for the first node's"


def test_an_admission_and_a_change_of_its_pools_labels_both_complete(monkeypatch):
    """pool_update locks the pool (FOR NO KEY UPDATE), then every member node; node_admit locked
    its node and, in the same statement (select_related), the node's pool: the other order, a
    deadlock. The node row is now locked alone."""
    _pg()
    from fleet import pools as fleet_pools
    from fleet import services as fleet_services
    from tests.factories import NodeFactory, PoolFactory

    monkeypatch.setattr("fleet.tasks.run_admission.apply_async", lambda *args, **kwargs: None)
    pool = PoolFactory(name="general")
    node = NodeFactory(pool=pool)
    done = threading.Event()
    # Racer 0 holds the pool row (its version checked), its member nodes not locked yet.
    inside = _racer_0_holds_after(monkeypatch, fleet_pools, "check_version", until=done, seconds=2)

    def racer(i):
        if i == 0:
            return fleet_pools.pool_update(
                pool_id=pool.pk, expected_version=pool.version, changes={"labels": {"zone": "b"}},
                actor=Actor.system("t"),
            ).labels  # fmt: skip
        assert inside.wait(10)
        try:
            return fleet_services.node_admit(
                node_id=node.pk, expected_version=node.version, actor=Actor.system("t")
            ).lifecycle
        finally:
            done.set()

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert outcome.results == [{"zone": "b"}, "admitting"]


def test_an_appeal_overturned_while_an_operator_releases_its_node_both_complete(owner, client_user, monkeypatch):
    """release_node locks the node, then closes its quarantine; appeal_resolve locked the appeal
    and, joined by select_related, the quarantine and the node FOR UPDATE in one statement: it held
    the quarantine while it waited for the node (a deadlock). It now locks the appeal alone, then
    the node, then reads the quarantine."""
    _pg()
    from marketplace import appeals
    from marketplace.models import Appeal
    from tests.marketplace.test_marketplace_races import ended_lease
    from tests.marketplace_support import ACTOR

    node, _ = ended_lease(owner, client_user)
    maintenance.quarantine_node(node_id=node.pk, reason="odd", evidence={}, actor=ACTOR)
    appeal = appeals.appeal_create(owner=owner, node_id=node.pk, statement="a disk error", actor=ACTOR)
    from fleet.models import Node

    version = Node.objects.get(pk=node.pk).version
    # Racer 0 holds the node row (release_node), the quarantine not closed yet.
    inside = _racer_0_waits_after(monkeypatch, maintenance, "lock_node")

    def racer(i):
        if i == 0:
            return maintenance.release_node(node_id=node.pk, expected_version=version, reason="ok", actor=ACTOR)[
                0
            ].lifecycle
        assert inside.wait(10)
        return appeals.appeal_resolve(
            appeal_id=appeal.pk, outcome="overturned", resolution="right", expected_version=appeal.version, actor=ACTOR
        ).state

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert outcome.results == ["pending", "overturned"]
    assert Appeal.objects.get(pk=appeal.pk).state == "overturned"
    assert Node.objects.get(pk=node.pk).lifecycle == "pending"


def _locking_statements_that_join(queries) -> list[str]:
    """The statements that lock rows (FOR [NO KEY] UPDATE) with a join and no OF: PostgreSQL locks
    the joined tables' rows too."""
    return [
        q["sql"]
        for q in queries
        if re.search(r"FOR (NO KEY )?UPDATE", q["sql"])
        and " JOIN " in q["sql"]
        and not re.search(r"FOR (NO KEY )?UPDATE OF ", q["sql"])
    ]


def test_node_admissions_preemption_notices_and_reconciliations_lock_their_own_row_only(owner, client_user):
    """finalize_admission, preemption_notice and reconcile_usage read a related row (the node's
    pool, the usage record's lease) that they do not need locked; joined by select_related into
    their ``select_for_update``, it was locked too (the first two: the pool row every node action
    of the pool and pool_update need, as in the tests above)."""
    _pg()
    from django.db import connection as db
    from django.test.utils import CaptureQueriesContext

    from fleet.admission import finalize_admission
    from marketplace.reconciliation import reconcile_usage
    from operations import preemption
    from operations.models import PoolOperations
    from tests.factories import NodeFactory
    from tests.marketplace.test_marketplace_races import ended_lease
    from tests.marketplace_support import ACTOR
    from tests.operations_support import ready_pool

    pending = NodeFactory()
    spot, members = ready_pool("spot", 1)
    PoolOperations.objects.create(pool=spot, spot=True)
    _, record = ended_lease(owner, client_user)
    with CaptureQueriesContext(db) as queries:
        assert finalize_admission(node_id=pending.pk, attempt=1, actor=Actor.system("t")) == "stale"
        assert preemption.preemption_notice(
            node_id=members[0][0].pk, deadline=timezone.now() + timedelta(seconds=600), source="agent",
            actor=Actor.system("t"),
        )[1]  # fmt: skip
        assert reconcile_usage(record.pk, actor=ACTOR, now=record.settle_after).state == "reconciled"
    assert len([q for q in queries.captured_queries if "FOR " in q["sql"]]) >= 3
    assert _locking_statements_that_join(queries.captured_queries) == []


def test_a_reconciliation_and_the_finalization_of_its_statement_both_complete(owner, client_user, monkeypatch):
    """reconcile_usage locks the usage record, then updates its line without locking the statement
    (refresh_line); finalize_statement locks the statement, then the records of its lines. The
    reconciliation holds its record while the finalization, holding the statement, waits for it:
    had refresh_line locked the statement (statement_for), each would wait for the other."""
    _pg()
    from marketplace import reconciliation, statements
    from marketplace.models import Statement, StatementLine
    from tests.marketplace.test_marketplace_races import ended_lease
    from tests.marketplace_support import ACTOR

    _, record = ended_lease(owner, client_user)
    statement = Statement.objects.get(owner=owner)
    after = max(statement.period_end, record.settle_after) + timedelta(hours=1)
    # Racer 0 holds the usage record FOR UPDATE, its outcome not written yet.
    inside = _racer_0_waits_after(monkeypatch, reconciliation, "evaluate")

    def racer(i):
        if i == 0:
            return reconciliation.reconcile_usage(record.pk, actor=ACTOR, now=after).state
        assert inside.wait(10)
        return statements.finalize_statement(
            statement_id=statement.pk, expected_version=statement.version, actor=ACTOR, now=after
        ).state

    outcome = race(racer, 2, timeout=30)
    assert outcome.errors == [], outcome.errors
    assert outcome.results == ["reconciled", "final"]
    line = StatementLine.objects.select_related("statement").get(usage_record=record)
    assert (line.statement_id, line.statement.state, line.state) == (statement.pk, "final", "reconciled")
    assert line.amount > 0 and line.statement.totals == {line.currency: str(line.amount)}


def test_a_reconciliation_attaching_a_line_while_its_statement_is_finalized_goes_to_the_next_one(
    owner, client_user, monkeypatch
):
    """The one path on which a reconciliation locks a statement: its record has no line yet
    (refresh_line → attach_line → statement_for). It holds the record, then waits for the
    statement held by the finalization, which never waits for that record (it locks the records
    of the statement's lines only), commits, and the line goes to the next period's statement."""
    _pg()
    from marketplace import reconciliation
    from marketplace.models import Statement, StatementLine
    from tests.marketplace.test_marketplace_races import ended_lease
    from tests.marketplace_support import ACTOR

    _, record = ended_lease(owner, client_user)
    StatementLine.objects.filter(usage_record=record).delete()  # a record whose line is not there yet
    statement = Statement.objects.get(owner=owner)
    after = max(statement.period_end, record.settle_after) + timedelta(hours=1)
    outcome = _race_a_finalization(
        monkeypatch, statement, after, lambda: reconciliation.reconcile_usage(record.pk, actor=ACTOR, now=after).state
    )
    assert outcome.errors == [], outcome.errors
    assert outcome.results == ["final", "reconciled"]
    line = StatementLine.objects.select_related("statement").get(usage_record=record)
    assert line.statement.state == "open" and line.statement.period_start == statement.period_end
