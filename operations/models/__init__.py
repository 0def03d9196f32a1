"""Pool operations: each pool's operation settings (target, spot, autoscaling), upgrades and the
nodes they move, machines asked of a provider, scale decisions, and preemptions.

Each row records the operation around a node (who asked, why, how far it got); the node's own
lifecycle stays on :class:`fleet.models.Node` and moves only through the maintenance services.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from maintenance.choices import EvictionPolicy

from ..choices import ProviderKind
from .autoscaling import Preemption, ProviderMachine, ScaleDecision, SeenDelivery
from .disruption import DisruptionBlock, NodeReplacement, NodeShape, Repair
from .upgrades import Upgrade, UpgradeNode

__all__ = [
    "DisruptionBlock",
    "NodeReplacement",
    "NodeShape",
    "PoolOperations",
    "Preemption",
    "ProviderMachine",
    "Repair",
    "ScaleDecision",
    "SeenDelivery",
    "Upgrade",
    "UpgradeNode",
    "default_disruption_budgets",
]


def default_disruption_budgets() -> list[dict]:
    """Every pool's default: automation disrupts at most 10 % of the pool's nodes at once
    (rounded up, at least 1), Karpenter's default budget."""
    return [{"nodes": "10%"}]


class PoolOperations(models.Model):
    """The operation settings of one pool (created on first use, one per pool).

    ``target``: what the pool's nodes must run, verified by admission (check ``upgrade_target``):
    ``{"version": "2.0.0", "agent_versions": ">=2.0,<3" (PEP 440, default ==version),
    "image": str, "kernel": str, "labels": {k: v}, "artifact": {"ref": str, "sha256": hex},
    "action": "agent"}``; empty = no target. ``node_template`` is the shape of a node the provider
    creates: ``{"resources": {name: canonical int}, "labels": {}, "taints": [...], "features": {},
    "price": "0.40"}`` (``price``: what one such machine costs per hour, optional, a decimal string).
    Times are seconds; ``scale_down_utilization`` a fraction 0..1 of allocatable.
    """

    pool = models.OneToOneField("fleet.Pool", on_delete=models.CASCADE, related_name="operations")
    target = models.JSONField(default=dict, blank=True)
    drain_policy = models.CharField(max_length=16, choices=EvictionPolicy.choices, default=EvictionPolicy.CHECKPOINT)
    drain_timeout = models.PositiveIntegerField(default=600, help_text="Seconds a system drain may take.")
    # Spot / preemptible.
    spot = models.BooleanField(default=False)
    fallback_pool = models.ForeignKey(
        "fleet.Pool",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="Where a preempted node's work is requeued first.",
    )
    # Autoscaling.
    provider = models.CharField(max_length=16, choices=ProviderKind.choices, default=ProviderKind.NONE, blank=True)
    provider_url = models.URLField(blank=True, help_text="webhook: the operator's URL; simulated: the control plane")
    provider_secret = models.CharField(max_length=200, blank=True, help_text="HMAC-SHA256 key of the webhook.")
    min_nodes = models.PositiveIntegerField(default=0)
    max_nodes = models.PositiveIntegerField(default=0, help_text="0: the provider adds no nodes.")
    node_template = models.JSONField(default=dict, blank=True)
    scale_up_delay = models.PositiveIntegerField(default=30, help_text="Seconds a request waits before scale-up.")
    scale_up_cooldown = models.PositiveIntegerField(default=120)
    max_nodes_per_scale_up = models.PositiveIntegerField(default=5, help_text="The rate: nodes per decision.")
    scale_down_utilization = models.FloatField(default=0.2)
    scale_down_after = models.PositiveIntegerField(default=600, help_text="Seconds underused before removal.")
    scale_down_cooldown = models.PositiveIntegerField(default=300)
    boot_timeout = models.PositiveIntegerField(default=600, help_text="Seconds a new machine has to become ready.")
    # Pool disruption budgets (operations.disruption): [{"nodes": "10%", "reasons": [...],
    # "schedule": cron, "duration": "8h", "timezone": "UTC"}]; validated when written.
    disruption_budgets = models.JSONField(default=default_disruption_budgets, blank=True)
    # Safe provisioning: launches in flight (requested or enrolled, not ready) at most this many; after
    # consecutive failures (provider errors, machines not ready within boot_timeout, refused at
    # admission) scale-up backs off exponentially: scale_up_cooldown × 2^(failures − 1), capped.
    max_launches_in_flight = models.PositiveIntegerField(default=10)
    scale_up_backoff_base = models.PositiveIntegerField(
        default=120, help_text="Seconds: the first back-off after a failure (doubled per consecutive failure)."
    )
    scale_up_backoff_max = models.PositiveIntegerField(default=3600, help_text="Seconds: the back-off's cap.")
    # Ordered pool ids (cluster-autoscaler's priority expander): while this pool backs off, its
    # waiting requests go to the first of these pools that can launch a node holding them.
    fallback_pools = models.JSONField(default=list, blank=True)
    # Consolidation (operations.consolidation): off while consolidate_after is null. An empty machine
    # is removed after consolidate_after seconds; an under-used one is replaced by a cheaper template
    # node, or merged into the others, when its leases fit and it saves at least this fraction.
    consolidate_after = models.PositiveIntegerField(null=True, blank=True, help_text="Seconds; empty = off.")
    consolidation_min_saving = models.FloatField(
        default=0.2, help_text="Fraction 0..1 of a node's hourly price a replacement must save."
    )
    # Expiry (operations.expiry): a node is replaced once it has served this long since its last
    # admission (plus a per-node spread); null = never (Karpenter's expireAfter: Never).
    expire_after = models.PositiveIntegerField(
        null=True, blank=True, help_text="Seconds after admission a node is replaced; empty: never."
    )
    # After an expired node has waited this long for the budgets, its drain is forced; null = never forced.
    termination_grace = models.PositiveIntegerField(
        null=True, blank=True, help_text="Seconds an expired node waits for the budgets before it is forced out."
    )
    consecutive_failures = models.PositiveIntegerField(default=0)
    backoff_until = models.DateTimeField(null=True, blank=True)
    last_scale_up_at = models.DateTimeField(null=True, blank=True)
    last_scale_down_at = models.DateTimeField(null=True, blank=True)
    # {node_id: ISO time it was first seen below the utilization threshold}.
    underused_since = models.JSONField(default=dict, blank=True)
    # Repair (operations.repair): [{"condition": "Ready", "status": "False", "for": 600, "action":
    # "reboot"}]; validated when written. The breaker: no automated repair while more than
    # repair_max_unhealthy of the members are unhealthy, at most repair_max_concurrent at once.
    repair_rules = models.JSONField(
        default=list,
        blank=True,
        help_text='[{"condition": "Ready", "status": "False", "for": "10m", "action": "reboot" | "replace" | '
        '"quarantine"}]. A quarantine revokes the node\'s credential: it comes back only when a person '
        "releases it.",
    )
    repair_max_unhealthy = models.FloatField(
        default=0.2, help_text="Fraction 0..1: no automated repair while more of the pool is unhealthy."
    )
    repair_max_concurrent = models.PositiveIntegerField(default=1, help_text="Repairs in progress at once.")
    repair_breaker_open = models.BooleanField(default=False, editable=False)
    repair_breaker_since = models.DateTimeField(null=True, blank=True, editable=False)
    repair_breaker_detail = models.TextField(blank=True, editable=False)
    version = models.PositiveIntegerField(default=1)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "pool operations"
        constraints = [
            models.CheckConstraint(
                condition=Q(max_nodes=0) | Q(max_nodes__gte=models.F("min_nodes")), name="poolops_max_at_least_min"
            ),
            models.CheckConstraint(
                condition=Q(scale_down_utilization__gte=0) & Q(scale_down_utilization__lte=1),
                name="poolops_utilization_fraction",
            ),
            models.CheckConstraint(
                condition=Q(consolidation_min_saving__gte=0) & Q(consolidation_min_saving__lte=1),
                name="poolops_saving_fraction",
            ),
            models.CheckConstraint(
                condition=Q(repair_max_unhealthy__gte=0) & Q(repair_max_unhealthy__lte=1),
                name="poolops_repair_unhealthy_fraction",
            ),
        ]

    def __str__(self) -> str:
        return f"operations of {self.pool}"
