"""What the liveness sweep and the renewal publish for the apps above ``fleet``.

``fleet`` sits below ``leases`` and ``maintenance`` (docs/foundation.md, "Which way dependencies point")
and never imports them. When a sweep or a renewal learns something those apps act on, it sends one
of these Django signals; the apps above connect their receivers in their ``AppConfig.ready()``.
Receivers run synchronously, inside the sender's transaction when it has one.

An applied status report is not a signal: its handlers run in an explicit order and may return
instructions for the node (fleet.instructions, :func:`~fleet.instructions.register_status_report_handler`).

Signals (``sender`` is always :class:`fleet.models.Node`):

``nodes_lost(node_ids, actor, reason)``
    inside the sweep's transaction, once per run, with the ids of nodes that just became ``lost``
    (leases declares their leases lost).

``node_revived(node_id)``
    inside the transaction of a renewal that moved a node that was not ``alive`` back to
    ``alive`` (rare: the renewal's hot path sends nothing); leases kicks its queue.

``device_identity_conflict(node, conflicts, actor)``
    after a report of ``node`` named device ids another live node holds (fleet.devices);
    ``conflicts`` is ``[{"device_id", "held_by", "type"}]``. maintenance quarantines ``node``
    (the later claimant) by its rule ``device_identity_conflict``.

``devices_above_verified(node, over, actor)``
    after a changed device report of ``node`` in which a type has more live devices than verified
    ones (types with none verified are not judged: nothing was verified to compare with);
    ``over`` is ``{type: {"declared": live devices, "verified": verified devices}}``. maintenance
    applies its ``capacity_above_verified`` rule (declared above verified × the factor).

``device_faulted(node, faulted, drained, actor)``
    after devices of ``node`` got a NoExecute (``faulted``: Device pks) or NoSchedule
    (``drained``) taint, outside any transaction; leases revokes and requeues the leases holding
    them that do not tolerate the taint (its device-fault trigger).

``benchmark_finished(benchmark, measured, actor, now)``
    inside the transaction that completed (``measured``: ``{"cpu", "memory"}`` canonical ints) or
    timed out (``measured`` None) a benchmark (fleet.admission); fleet.reverification finishes
    the re-verification that asked for it. Sent by fleet for fleet (fleet.admission is below
    fleet.reverification, which uses its checks), connected in ``FleetConfig.ready()``.

Anything that needs the node to act sends no signal back: it sets a bit of the node's
pending-instructions marker through :func:`fleet.instructions.post_instructions`, which the next
renewal reports.
"""

from __future__ import annotations

from django.dispatch import Signal

nodes_lost = Signal()
node_revived = Signal()
device_identity_conflict = Signal()
device_faulted = Signal()
devices_above_verified = Signal()
benchmark_finished = Signal()
