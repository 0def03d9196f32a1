"""Automatic quarantine rules, evaluated by the control plane (filled by the maintenance issue)."""

from __future__ import annotations


def evaluate_heartbeat(node, *, usage: dict, agent_version: str, actor) -> str | None:
    """Check an applied heartbeat against the automatic quarantine rules.

    Args:
        node: the fleet.Node (saved, inside the heartbeat's transaction).
        usage: ``{resource: canonical int}`` the node reported.
        agent_version: the agent version in the heartbeat.
        actor: fleet.events.Actor.

    Returns:
        The rule code that quarantined the node (e.g. ``"impossible_usage"``), or None.
    """
    return None
