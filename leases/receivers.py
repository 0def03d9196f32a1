"""Receivers of fleet's signals and status-report handlers that reconcile or end leases
(connected in leases.apps): wiring above leases.reconcile, so leases.signals, which
leases.lifecycle uses, stays below it (issue 28, step 4)."""

from __future__ import annotations

from fleet.models import Node

from . import reconcile


def reconcile_status_report(sender, node: Node, incarnation: int, leases, restarted: bool, actor, **kwargs):
    """A status-report handler (fleet.instructions): reconcile the leases the node reported; the returned
    instructions (stop, checkpoint, assigned) go back in the heartbeat response."""
    # Looked up on each call (tests replace leases.reconcile.reconcile_heartbeat).
    return reconcile.reconcile_heartbeat(
        node, incarnation=incarnation, reported=leases, restarted=restarted, actor=actor
    )


def lose_leases_of_lost_nodes(sender, node_ids, actor, reason: str, **kwargs):
    """fleet.signals.nodes_lost: every live lease on those nodes is lost (capacity freed)."""
    reconcile.lose_node_leases(node_ids, actor=actor, reason=reason)
