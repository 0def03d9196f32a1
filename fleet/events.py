"""Who did it, and the append-only event log every service writes in its own transaction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nodepool.db import insert_row

from .choices import ActorType
from .models import Node, NodeEvent


@dataclass(frozen=True)
class Actor:
    """The author of a change: a user (operator), a node (its credential) or a system task.

    ``request_id`` is the HTTP request id or the Celery task id, for tracing.
    """

    type: str
    name: str
    user: Any = None
    request_id: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_request(cls, request) -> Actor:
        """The actor behind a DRF/Django request (a node credential or a user)."""
        request_id = getattr(request, "request_id", "") or ""
        node = getattr(request, "node", None)
        if node is not None:
            return cls(ActorType.NODE, f"node:{node.pk}", request_id=request_id)
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            return cls(ActorType.USER, user.get_username(), user=user, request_id=request_id)
        return cls(ActorType.SYSTEM, "anonymous", request_id=request_id)

    @classmethod
    def system(cls, name: str, task_id: str = "") -> Actor:
        """A control-plane task (Celery task name, management command)."""
        return cls(ActorType.SYSTEM, name, request_id=task_id or "")

    @classmethod
    def for_node(cls, node: Node, request_id: str = "") -> Actor:
        return cls(ActorType.NODE, f"node:{node.pk}", request_id=request_id)


def event_row(
    node: Node | Any | None,
    type: str,
    actor: Actor,
    *,
    from_state: str = "",
    to_state: str = "",
    reason: str = "",
    data: dict | None = None,
    pool: Any = None,
    lease_id: Any = None,
    workload_id: str = "",
    subject_type: str = "",
    subject_id: Any = "",
) -> NodeEvent:
    """An unsaved event (for ``bulk_create`` in set-based sweeps); see :func:`record_event`."""
    node_id = node.pk if isinstance(node, Node) else node
    if pool is None and isinstance(node, Node):
        pool = node.pool_id
    return NodeEvent(
        node_id=node_id,
        pool_id=getattr(pool, "pk", pool),
        lease_id=lease_id,
        workload_id=(workload_id or "")[:200],
        subject_type=subject_type or "",
        subject_id=str(subject_id or "")[:64],
        type=type,
        from_state=from_state or "",
        to_state=to_state or "",
        actor_type=actor.type,
        actor_user=actor.user if actor.type == ActorType.USER else None,
        actor_name=actor.name[:150],
        reason=reason or "",
        request_id=(actor.request_id or "")[:64],
        data=data or {},
    )


def record_event(node: Node | Any | None, type: str, actor: Actor, **fields: Any) -> NodeEvent:
    """Append one event. Call it inside the transaction of the change it records.

    ``node`` is a Node, a node primary key, or None for an event that belongs to no node (a pool's
    mass-silence guard, an upgrade, an appeal). Keyword ``fields``: ``from_state``, ``to_state``,
    ``reason``, ``data`` (a JSON object), ``pool`` (a Pool or its primary key; for a Node instance
    it defaults to the node's pool), ``lease_id`` (UUID), ``workload_id`` and
    ``subject_type``/``subject_id`` (the other things the event belongs to).
    """
    # One prepared INSERT (nodepool.db.insert_row) rather than save(): every grant and lease
    # change records an event, and nothing listens to an event's save.
    return insert_row(event_row(node, type, actor, **fields))
