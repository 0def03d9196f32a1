"""Who did it, and the append-only event log every service writes in its own transaction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


def record_event(
    node: Node | Any,
    type: str,
    actor: Actor,
    *,
    from_state: str = "",
    to_state: str = "",
    reason: str = "",
    data: dict | None = None,
) -> NodeEvent:
    """Append one :class:`NodeEvent`. Call it inside the transaction of the change it records.

    ``node`` may be a Node or a node primary key.
    """
    node_id = node.pk if isinstance(node, Node) else node
    return NodeEvent.objects.create(
        node_id=node_id,
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


def event_row(
    node_id,
    type: str,
    actor: Actor,
    *,
    from_state: str = "",
    to_state: str = "",
    reason: str = "",
    data: dict | None = None,
) -> NodeEvent:
    """An unsaved NodeEvent, for ``bulk_create`` in set-based sweeps."""
    return NodeEvent(
        node_id=node_id,
        type=type,
        from_state=from_state,
        to_state=to_state,
        actor_type=actor.type,
        actor_user=actor.user if actor.type == ActorType.USER else None,
        actor_name=actor.name[:150],
        reason=reason,
        request_id=(actor.request_id or "")[:64],
        data=data or {},
    )
