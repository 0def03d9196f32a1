"""Node availability evidence from status reports (docs/marketplace.md, "Availability evidence").

A status report of a node that offers capacity (lifecycle ``ready`` and not cordoned, or
``draining`` with work still on it) extends the node's open :class:`NodeAvailability` interval to
the report's receipt time, or opens one with a snapshot of the node's allocatable capacity. The
open interval continues only while nothing that decides the offer moved:

* the same incarnation (a restart cuts it: ``restart``);
* the same node ``version`` (lifecycle, pool, cordon, reservations bump it: ``changed``);
* no silence: the interval was last extended within the pool's grace, or the node has stayed
  ``alive`` since (its ``liveness_changed_at`` is not later than the last extension: renewals
  kept it alive between two status reports), and never more than :data:`MAX_SILENCE_REPORTS`
  status-report intervals ago (``silence``);
* not longer than :data:`MAX_SPAN` (``cut``): the capacity snapshot is taken again at least hourly.

Cost on the status-report path: one prepared UPDATE of one row (by the partial unique index of
open intervals) when the interval continues; a SELECT of the node's resources and an INSERT only
when one opens. A node that does not offer pays one UPDATE closing nothing. No query reads the node.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import IntegrityError, connection, transaction

from fleet.choices import Lifecycle
from fleet.models import Node, NodeResource
from fleet.pacing import pool_timings
from nodepool.db import prepared_cursor

from .models import AvailabilityClose, NodeAvailability

MAX_SPAN = timedelta(hours=1)
MAX_SILENCE_REPORTS = 3
OFFERING = (Lifecycle.READY, Lifecycle.DRAINING)


def offering(node: Node) -> bool:
    """Whether ``node`` offers its capacity: ready and not cordoned, or draining (its leases run on)."""
    return node.lifecycle == Lifecycle.DRAINING or (node.lifecycle == Lifecycle.READY and not node.cordoned)


def _table() -> str:
    return connection.ops.quote_name(NodeAvailability._meta.db_table)


def _at(value: datetime):
    return NodeAvailability._meta.get_field("last_seen_at").get_db_prep_value(value, connection)


def _node(node_id):
    return Node._meta.pk.get_db_prep_value(node_id, connection)


def record_status_report(sender, node: Node, incarnation: int, **kwargs) -> None:
    """A status-report handler (fleet.instructions, order 400): extend or open the node's availability interval.

    ``node`` is the heartbeat's updated node (``last_status_report_at`` is this report's receipt
    time). Returns no instructions. Safe under concurrent reports of one node: the conditional
    UPDATE and the partial unique index decide; a losing opener changes nothing.
    """
    now = node.last_status_report_at
    if now is None:
        return None
    if node.lifecycle not in OFFERING:
        close_open(node_id=node.pk, reason=AvailabilityClose.NOT_OFFERING)
        return None
    # The fast path reads only fields the heartbeat loaded (its node has the others deferred: each
    # would cost a query). The node version stands for the rest: an interval opens only for a node
    # that offers, and a cordon (or anything else that could end the offer) bumps the version.
    timings = pool_timings(node.pool_id)
    cutoff = now - timedelta(seconds=timings.unreachable_after)
    alive_since = node.liveness_changed_at
    if alive_since is not None and alive_since < cutoff:
        # Alive throughout since before the grace: renewals carried it; bounded all the same.
        cutoff = max(alive_since, now - timedelta(seconds=MAX_SILENCE_REPORTS * timings.status_report_interval))
    sql = (
        f"UPDATE {_table()} SET last_seen_at = %s "  # noqa: S608 -- the table name from the model
        "WHERE node_id = %s AND ended_at IS NULL AND incarnation = %s AND node_version = %s "
        "AND last_seen_at >= %s AND started_at > %s AND last_seen_at <= %s"
    )
    params = [_at(now), _node(node.pk), incarnation, node.version, _at(cutoff), _at(now - MAX_SPAN), _at(now)]
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        if cursor.rowcount:
            return None
    if not offering(node):  # reads the deferred cordon flag: only off the fast path
        close_open(node_id=node.pk, reason=AvailabilityClose.NOT_OFFERING)
        return None
    _open(node=node, incarnation=incarnation, now=now, cutoff=cutoff)
    return None


def close_open(*, node_id, reason: str) -> int:
    """Close the node's open interval at its last evidence (``ended_at = last_seen_at``)."""
    with prepared_cursor() as cursor:
        cursor.execute(
            f"UPDATE {_table()} SET ended_at = last_seen_at, end_reason = %s "  # noqa: S608
            "WHERE node_id = %s AND ended_at IS NULL",
            [reason, _node(node_id)],
        )
        return cursor.rowcount


def _open(*, node: Node, incarnation: int, now: datetime, cutoff: datetime) -> None:
    """Close what is open (with why) and open an interval at ``now`` with the capacity snapshot."""
    with transaction.atomic():
        current = NodeAvailability.objects.select_for_update().filter(node_id=node.pk, ended_at__isnull=True).first()
        if current is not None:
            if current.last_seen_at > now:
                return  # a later report got here first: this one is older news
            if current.incarnation != incarnation:
                reason = AvailabilityClose.RESTART
            elif current.node_version != node.version:
                reason = AvailabilityClose.CHANGED
            elif current.last_seen_at < cutoff:
                reason = AvailabilityClose.SILENCE
            else:
                reason = AvailabilityClose.CUT
            if reason == AvailabilityClose.CUT:
                # The span continues without a gap: the old interval ends where the new one starts.
                NodeAvailability.objects.filter(pk=current.pk).update(last_seen_at=now, ended_at=now, end_reason=reason)
            else:
                NodeAvailability.objects.filter(pk=current.pk).update(ended_at=current.last_seen_at, end_reason=reason)
        allocatable = dict(NodeResource.objects.filter(node_id=node.pk).values_list("name", "allocatable"))
        try:
            with transaction.atomic():
                NodeAvailability.objects.create(
                    node_id=node.pk,
                    pool_id=node.pool_id,
                    owner_id=node.owner_id,
                    incarnation=incarnation,
                    node_version=node.version,
                    allocatable=allocatable,
                    started_at=now,
                    last_seen_at=now,
                )
        except IntegrityError:  # a racing report of the same node opened it: one is enough
            pass
