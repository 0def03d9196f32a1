"""The one append-only event table of the control plane (``NodeEvent``, alias ``Event``)."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from .. import event_types
from ..choices import ActorType
from .nodes import Node, Pool


class NodeEvent(models.Model):
    """One append-only event of the control plane, written in the same transaction as its change.

    The general event model: an event belongs to a node, a pool, a lease, a workload, or another
    subject (an upgrade, an appeal, a statement…: ``subject_type`` + ``subject_id``), to several of
    these, or to none (a fleet-wide sweep outcome). ``lease_id`` and ``subject_*`` are plain
    values rather than foreign keys because the models they name live in higher apps (leases,
    maintenance), which ``fleet`` never imports (docs/foundation.md, "Which way dependencies point").
    The model keeps its historical name; ``Event`` is its alias.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="events", null=True, blank=True)
    pool = models.ForeignKey(
        Pool,
        on_delete=models.SET_NULL,
        related_name="events",
        null=True,
        blank=True,
        help_text="The pool the event belongs to (set for node events too, as it was when written).",
    )
    lease_id = models.UUIDField(null=True, blank=True, db_index=True)
    workload_id = models.CharField(max_length=200, blank=True, db_index=True)
    subject_type = models.CharField(max_length=32, blank=True, help_text="upgrade, appeal, statement…")
    subject_id = models.CharField(max_length=64, blank=True)
    # Each app declares its own types (fleet.event_types); a callable, so a new type needs no migration.
    type = models.CharField(max_length=32, choices=event_types.choices)
    from_state = models.CharField(max_length=32, blank=True)
    to_state = models.CharField(max_length=32, blank=True)
    actor_type = models.CharField(max_length=8, choices=ActorType.choices)
    actor_user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    actor_name = models.CharField(max_length=150, blank=True)
    reason = models.TextField(blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["node", "-created_at"], name="nodeevent_node_recent"),
            models.Index(fields=["pool", "-created_at"], name="nodeevent_pool_recent"),
            models.Index(fields=["subject_type", "subject_id"], name="nodeevent_subject"),
        ]

    def __str__(self) -> str:
        return f"{self.type} {self.from_state}→{self.to_state}"


Event = NodeEvent
