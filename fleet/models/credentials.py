"""Enrollment and identity secrets: pool bootstrap tokens and node credentials."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

from .nodes import Node, Pool


class BootstrapToken(models.Model):
    """A pool-scoped enrollment secret with an expiry and a maximum number of uses.

    A token that names a ``node`` enrolls no new node: it lets an agent take that node over (an
    imported node's first agent, an agent whose credential expired or was revoked), keeping the
    node's identity (fleet.services.node_enroll). Such a token is used once.
    """

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="bootstrap_tokens")
    # CASCADE, not SET_NULL: a token naming a deleted node must not become a token for a new node.
    node = models.ForeignKey(
        "Node",
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="+",
        help_text="The node an agent takes over with this token (none: the token enrolls new nodes).",
    )
    description = models.CharField(max_length=200, blank=True)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, editable=False)
    expires_at = models.DateTimeField()
    max_uses = models.PositiveIntegerField(default=1)
    uses = models.PositiveIntegerField(default=0)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="Owner recorded on nodes enrolled with this token.",
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=Q(uses__lte=models.F("max_uses")), name="bootstraptoken_uses_within_max")
        ]

    def __str__(self) -> str:
        return f"{self.pool.name}/{self.prefix}"


class NodeCredential(models.Model):
    """A short-lived bearer credential scoped to one node's own operations; stored hashed."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="credentials")
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, editable=False)
    issuer = models.CharField(max_length=150, help_text="enrollment, rotation, or the operator who issued it")
    agent_version = models.CharField(max_length=64, blank=True)
    issued_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    rotated_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # The lineage: the credential a rotation made from this one. Only a credential that nothing
    # superseded may rotate (fleet.credentials).
    superseded_by = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="supersedes", editable=False
    )

    class Meta:
        ordering = ["-issued_at"]
        indexes = [models.Index(fields=["node", "expires_at"], name="nodecredential_node_expiry")]

    def __str__(self) -> str:
        return f"{self.node_id}/{self.prefix}"
