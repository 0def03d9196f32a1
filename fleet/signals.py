"""What the heartbeat and the liveness sweep publish for the apps above ``fleet``.

``fleet`` sits below ``leases`` and ``maintenance`` (docs/foundation.md, "Which way dependencies point")
and never imports them. When a status report or a sweep learns something those apps act on, it
sends one of these Django signals; ``leases`` and ``maintenance`` connect their receivers in their
``AppConfig.ready()``. Receivers run in the order the apps are installed (``leases`` first, so a
quarantine rule sees the leases reconciliation left), synchronously, inside the sender's
transaction when it has one.

Signals (``sender`` is always :class:`fleet.models.Node`):

``status_report_applied(node, incarnation, leases, usage, agent_version, restarted, actor)``
    after an applied status report (heartbeat). ``node`` is the updated instance with its pool,
    ``leases`` the reported ``[{"lease_id", "fencing_token", "state"}]``, ``usage``
    ``{resource: canonical int}``. A receiver may return a dict of instructions for the node:
    ``{"stop": [lease ids], "checkpoint": [lease ids], "assigned": [{...}]}`` (leases does);
    the heartbeat merges what receivers return into its response (docs/api-contract.md).

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

``device_faulted(node, faulted, drained, actor)``
    after devices of ``node`` got a NoExecute (``faulted``: Device pks) or NoSchedule
    (``drained``) taint, outside any transaction; leases revokes and requeues the leases holding
    them that do not tolerate the taint (its device-fault trigger).

Anything that needs the node to act sends no signal back: it sets a bit of the node's
pending-instructions marker through :func:`fleet.instructions.post_instructions`, which the next
renewal reports.
"""

from __future__ import annotations

from django.dispatch import Signal

status_report_applied = Signal()
nodes_lost = Signal()
node_revived = Signal()
device_identity_conflict = Signal()
device_faulted = Signal()


def merged_instructions(responses) -> dict:
    """Merge the dicts receivers of :data:`status_report_applied` returned (lists are concatenated;
    the first non-list value of a key wins)."""
    merged: dict = {}
    for _receiver, response in responses:
        for key, value in (response or {}).items():
            if isinstance(value, list):
                merged.setdefault(key, [])
                merged[key] = [*(merged[key] or []), *value]
            else:
                merged.setdefault(key, value)
    return merged
