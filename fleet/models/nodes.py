"""Pools and nodes: the pool's policy, the node's identity and lifecycle (FSM), its holds and its
capacity inventory (:class:`NodeResource`)."""

from __future__ import annotations

import secrets
import uuid

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django_fsm import ConcurrentTransitionMixin, FSMField, transition

from nodepool.fsm import SerializedFSMRefresh

from ..choices import (
    AdmissionMode,
    Health,
    Lifecycle,
    Liveness,
    PoolKind,
    ReverificationBusyPolicy,
    SchedulingPolicy,
)

DEFAULT_UNHEALTHY_CONDITIONS = ["MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable"]
DEFAULT_DEGRADED_CONDITIONS = ["ClockSkew"]


class Pool(models.Model):
    """A named group of nodes managed as a unit.

    ``reservations`` maps a reservation class (``system``, ``runtime``, ``monitoring``,
    ``failure_margin``) to ``{resource: canonical amount}`` (cpu millicores, bytes, counts);
    their sum per resource is subtracted from each node's capacity to give allocatable.
    Liveness timings are seconds. ``taints`` is a list of ``{"key", "value", "effect"}``.
    """

    name = models.SlugField(max_length=63, unique=True)
    description = models.TextField(blank=True)
    kind = models.CharField(max_length=16, choices=PoolKind.choices, default=PoolKind.STANDARD)
    labels = models.JSONField(default=dict, blank=True)
    taints = models.JSONField(default=list, blank=True)
    reservations = models.JSONField(default=dict, blank=True)
    # Admission policy.
    admission_mode = models.CharField(max_length=16, choices=AdmissionMode.choices, default=AdmissionMode.MANUAL)
    allowed_agent_versions = models.CharField(
        max_length=200, blank=True, help_text="PEP 440 specifier set, e.g. '>=1.0,<2'; empty allows any."
    )
    required_capabilities = models.JSONField(
        default=dict, blank=True, help_text='{"resources": {"cpu": 1000}, "features": {"arch": "amd64"}}'
    )
    required_labels = models.JSONField(default=dict, blank=True)
    benchmark_required = models.BooleanField(default=False)
    benchmark_tolerance = models.FloatField(default=0.8, help_text="Minimum measured/declared ratio accepted.")
    benchmark_timeout = models.PositiveIntegerField(default=300, help_text="Seconds a node has to answer.")
    attestation_required = models.BooleanField(default=False)
    attestation_public_key = models.TextField(blank=True, help_text="PEM public key (Ed25519) trusted for attestation.")
    trust_node_labels = models.BooleanField(default=False, help_text="Use node-declared labels for placement.")
    # Resources a node may report using without having them in its inventory (e.g. a scratch
    # volume the platform does not account); any other undeclared resource in use is impossible.
    allowed_undeclared_resources = models.JSONField(
        default=list, blank=True, help_text="Resource names whose use need not be in a node's inventory."
    )
    # Liveness timings (seconds). Defaults: Kubernetes' node-monitor grace (40 s) and 5 min eviction.
    heartbeat_interval = models.PositiveIntegerField(default=10, help_text="Seconds between liveness renewals.")
    # Status reports (full heartbeats) come on change and at least this often (KEP-589's split:
    # Kubernetes' nodeStatusReportFrequency is 5 min; 60 s keeps usage evidence fresh).
    status_report_interval = models.PositiveIntegerField(
        default=60, help_text="Seconds: nodes send a full status report at least this often."
    )
    heartbeat_grace = models.PositiveIntegerField(default=40)
    loss_threshold = models.PositiveIntegerField(default=300)
    # Health policy: condition types whose status "True" makes a node unhealthy / degraded
    # (for "Ready" and other positive conditions, "False" is the bad status).
    unhealthy_conditions = models.JSONField(default=list, blank=True)
    degraded_conditions = models.JSONField(default=list, blank=True)
    # Devices (fleet.devices): a device tainted automatically by a fault returns on its own after
    # this many seconds without a new fault (or at once after the host rebooted).
    device_recovery_seconds = models.PositiveIntegerField(
        default=900, help_text="Seconds a faulted device must stay healthy before it returns by itself."
    )
    scheduling_policy = models.CharField(
        max_length=16, choices=SchedulingPolicy.choices, default=SchedulingPolicy.BINPACK
    )
    # Scheduled re-verification (fleet.reverification): off while the period is null. Each node's
    # next check falls at a random moment in the last ``window`` seconds of each ``period``,
    # drawn by the server and never shown to the node. Both 60 s – 30 days, window <= period.
    reverification_period = models.PositiveIntegerField(
        null=True, blank=True, help_text="Seconds between a node's re-verifications; empty turns them off."
    )
    reverification_window = models.PositiveIntegerField(
        default=3600, help_text="Seconds: the check falls at a random time within the last window of each period."
    )
    reverification_tolerance_percent = models.FloatField(
        default=20.0, help_text="Percent a measurement may fall below verified before the node is deverified."
    )
    reverification_busy_policy = models.CharField(
        max_length=8, choices=ReverificationBusyPolicy.choices, default=ReverificationBusyPolicy.FREE
    )
    # Observability (docs/observability.md). Alert rules cannot read the database, so the Node
    # Ready SLO is exported as the gauge nodepool_pool_ready_ratio_objective for the burn-rate rules.
    ready_ratio_objective = models.FloatField(
        default=0.99, help_text="Node Ready SLO: the fraction of in-service nodes that should be Ready (0.5-0.99999)."
    )
    # The request classes the operator cares about; the pool's health answers "can serve N now" for each.
    request_classes = models.JSONField(
        default=list,
        blank=True,
        help_text='[{"name": "gpu-small", "shape": "gpu-small"}] or [{"name": ..., "resources": {"cpu": "4"}}]',
    )
    # "Can serve N now" per request class, refreshed by the beat task leases.refresh_request_class_fits
    # ({class name: N or None}); /metrics and the fleet overview read it instead of re-running
    # placement filters over the whole pool at every scrape.
    request_class_fits = models.JSONField(default=dict, blank=True, editable=False)
    request_class_fits_at = models.DateTimeField(null=True, blank=True, editable=False)
    version = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(ready_ratio_objective__gte=0.5, ready_ratio_objective__lt=1.0),
                name="pool_ready_objective_in_range",
            ),
            models.CheckConstraint(
                condition=Q(heartbeat_grace__gte=2 * models.F("heartbeat_interval")),
                name="pool_grace_at_least_two_intervals",
            ),
            models.CheckConstraint(
                condition=Q(loss_threshold__gte=models.F("heartbeat_grace")), name="pool_loss_after_grace"
            ),
        ]

    def __str__(self) -> str:
        return self.name

    def reserved_totals(self) -> dict[str, int]:
        """Sum of all reservation classes per resource (canonical units)."""
        totals: dict[str, int] = {}
        for amounts in (self.reservations or {}).values():
            for resource, amount in (amounts or {}).items():
                totals[resource] = totals.get(resource, 0) + int(amount)
        return totals


class Node(SerializedFSMRefresh, ConcurrentTransitionMixin, models.Model):
    """A worker machine. ``id`` is its durable identity: never derived from hostname or address.

    Capability dicts (``declared``, ``measured``, ``verified``) share one shape:
    ``{"resources": {name: canonical int}, "accelerators": [{"type", "model", "memory", "count"}],
    "features": {"arch", "os", "kernel", "runtimes": [...], "network_class", "services": [...]}}``.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="nodes")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="nodes"
    )
    # Mutable metadata.
    hostname = models.CharField(max_length=253, blank=True)
    display_name = models.CharField(max_length=200, blank=True)
    addresses = models.JSONField(default=list, blank=True)
    # Labels the platform governs (trusted) and those the node declares (untrusted by default).
    labels = models.JSONField(default=dict, blank=True)
    node_labels = models.JSONField(default=dict, blank=True)
    taints = models.JSONField(default=list, blank=True)
    # {"key:effect": ISO 8601}: when each taint was put on this node (fleet.taints); NoExecute
    # tolerationSeconds count from it.
    taints_added_at = models.JSONField(default=dict, blank=True)
    # Capability: self-reported, measured by benchmarks, accepted by admission.
    declared = models.JSONField(default=dict, blank=True)
    measured = models.JSONField(default=dict, blank=True)
    verified = models.JSONField(default=dict, blank=True)

    # Lifecycle (administrative intent). Only transitions change it.
    lifecycle = FSMField(max_length=16, choices=Lifecycle.choices, default=Lifecycle.PENDING, protected=True)
    lifecycle_reason = models.TextField(blank=True)
    lifecycle_changed_at = models.DateTimeField(null=True, blank=True)

    # Liveness, computed from the server's receipt times only.
    liveness = models.CharField(max_length=16, choices=Liveness.choices, default=Liveness.UNKNOWN)
    liveness_changed_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    # Precomputed deadline of the next liveness degradation (healthchecks' "alert_after"):
    # the sweep selects rows with next_liveness_check_at <= now through a partial index.
    next_liveness_check_at = models.DateTimeField(null=True, blank=True)

    # Cordon: true while the node has any active hold (NodeHold), kept in step with its holds
    # under the node's row lock by maintenance.holds. Stored so that placement filters on a column.
    cordoned = models.BooleanField(default=False)

    # Readiness (the node's word) and health (the control plane's judgement).
    ready = models.BooleanField(default=False)
    ready_reason = models.CharField(max_length=200, blank=True)
    conditions = models.JSONField(default=list, blank=True)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.UNKNOWN)
    health_reasons = models.JSONField(default=list, blank=True)

    # Agent session: incarnation (bumped at each agent start) and sequence within it.
    incarnation = models.PositiveBigIntegerField(default=1)
    sequence = models.BigIntegerField(default=-1)
    restart_count = models.PositiveIntegerField(default=0)
    agent_version = models.CharField(max_length=64, blank=True)
    clock_skew_seconds = models.FloatField(null=True, blank=True)
    usage = models.JSONField(default=dict, blank=True)

    # The renewal/status-report split (fleet.renewals). ``instructions`` is the pending-instructions
    # marker: a bit set (fleet.instructions.Instruction) that higher apps raise when something waits
    # for the node and that an applied status report clears; the renewal returns it as its flags, so
    # it never joins into leases or maintenance tables. The ``*_not_before`` columns are the flood
    # guard (half the interval last told, per message kind) and ``interval_given`` that interval.
    instructions = models.PositiveIntegerField(default=0)
    interval_given = models.FloatField(null=True, blank=True)
    renewal_not_before = models.DateTimeField(null=True, blank=True)
    status_report_not_before = models.DateTimeField(null=True, blank=True)
    last_status_report_at = models.DateTimeField(null=True, blank=True)
    # When the StatusReportOverdue condition is due (2 status-report intervals after the last
    # report); the sweep finds due rows through a partial index, like next_liveness_check_at.
    status_report_due_at = models.DateTimeField(null=True, blank=True)
    status_report_overdue = models.BooleanField(default=False)

    # Enrollment evidence.
    bootstrap_token = models.ForeignKey(
        "BootstrapToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="nodes"
    )
    enrolled_at = models.DateTimeField(null=True, blank=True)
    enrolled_agent_version = models.CharField(max_length=64, blank=True)
    attestation = models.JSONField(default=dict, blank=True)
    attestation_verified = models.BooleanField(null=True, blank=True)
    attestation_detail = models.TextField(blank=True)
    admission_attempt = models.PositiveIntegerField(default=0)

    # Devices (fleet.devices): the host's boot id from the last status report (a change means a
    # reboot, which lifts reset-pending device taints) and a digest of the last applied device
    # inventory, so that an unchanged inventory without health news costs no statement.
    boot_id = models.CharField(max_length=64, blank=True)
    # The reliability score in [0, 1] over the last RELIABILITY_WINDOW_DAYS (fleet.reliability): a
    # copy of what the rollup computed, so that placement compares a column instead of summing
    # rollups per request. NULL: unrated (fewer than RELIABILITY_MIN_SAMPLE counted leases).
    reliability = models.FloatField(null=True, blank=True, editable=False)
    devices_digest = models.CharField(max_length=64, blank=True)
    # The node's live devices as the device rules see them (fleet.device_counts.fingerprint_of: a
    # sha256 of their attributes, usability and verification, not their ids nor who holds them),
    # '' for none or not yet computed. Kept by sync_counts, which every device writer but the
    # claim calls; nodes with the same fingerprint and no live holds give a device request the same
    # answer, so the 409's census decides it once per fingerprint (leases.sql.devices).
    device_fingerprint = models.CharField(max_length=64, blank=True, default="", editable=False)

    # Incident response: set by quarantine; other services read it to refuse artifacts and logs.
    artifacts_blocked = models.BooleanField(default=False)

    # Identity in an outside inventory the node was imported from ("k8s:<metadata.uid>" for
    # fleet.k8s_import); re-imports find the node by it. Empty for nodes that enrolled themselves.
    external_id = models.CharField(max_length=200, blank=True, default="")

    version = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            models.UniqueConstraint(
                fields=["external_id"], condition=~Q(external_id=""), name="node_unique_external_id"
            ),
        ]
        indexes = [
            models.Index(fields=["pool", "lifecycle"], name="node_pool_lifecycle"),
            models.Index(
                fields=["next_liveness_check_at"],
                name="node_liveness_due",
                condition=Q(next_liveness_check_at__isnull=False),
            ),
            models.Index(
                fields=["status_report_due_at"],
                name="node_status_report_due",
                condition=Q(status_report_due_at__isnull=False),
            ),
        ]
        permissions = [
            ("admit_node", "Can admit nodes"),
            ("operate_node", "Can cordon, drain and return nodes to service"),
            ("quarantine_node", "Can quarantine nodes"),
            ("release_node", "Can release nodes from quarantine"),
        ]

    def __str__(self) -> str:
        return self.display_name or self.hostname or str(self.id)

    def reload(self) -> Node:
        """Bring this instance's fields up to date with its row, in place (one SELECT); returns it.

        Not ``refresh_from_db``: django-fsm's version lifts the ``protected`` flag on the field
        object every instance shares while it reloads, so two threads refreshing nodes at once can
        hit "Direct lifecycle modification is not allowed". This sets the protected field the one
        way protection permits (absent from the instance dict) and resets the
        ConcurrentTransitionMixin baseline. Cached relations are kept (a cached pool is dropped
        only when ``pool_id`` changed; a Pool row edited meanwhile is not re-read).
        """
        fresh = type(self).objects.get(pk=self.pk)
        for field in self._meta.concrete_fields:
            if field.attname == "lifecycle":
                self.__dict__.pop("lifecycle", None)
            setattr(self, field.attname, getattr(fresh, field.attname))
        self._update_initial_state()
        return self

    # --- lifecycle transitions: memory only, no side effects (services save and log) ----------
    @transition(field=lifecycle, source=Lifecycle.PENDING, target=Lifecycle.ADMITTING)
    def start_admission(self):
        """pending → admitting: admission checks will run."""

    @transition(field=lifecycle, source=Lifecycle.ADMITTING, target=Lifecycle.READY)
    def admit(self):
        """admitting → ready: every admission check passed."""

    @transition(field=lifecycle, source=Lifecycle.ADMITTING, target=Lifecycle.REJECTED)
    def reject(self):
        """admitting → rejected: at least one admission check failed."""

    @transition(field=lifecycle, source=Lifecycle.READY, target=Lifecycle.DRAINING)
    def drain(self):
        """ready → draining: existing work moves off by a deadline (the drain also places a hold)."""

    @transition(field=lifecycle, source=Lifecycle.DRAINING, target=Lifecycle.READY)
    def cancel_drain(self):
        """draining → ready; the drain's hold goes with it, other holds stay (maintenance.drains)."""

    @transition(field=lifecycle, source=Lifecycle.DRAINING, target=Lifecycle.MAINTENANCE)
    def complete_drain(self):
        """draining → maintenance: every lease is terminal and no longer reported."""

    @transition(field=lifecycle, source=Lifecycle.MAINTENANCE, target=Lifecycle.ADMITTING)
    def return_to_service(self):
        """maintenance → admitting: admission runs again before the node is ready."""

    @transition(
        field=lifecycle,
        source=[s for s in Lifecycle.values if s not in (Lifecycle.RETIRED, Lifecycle.QUARANTINED)],
        target=Lifecycle.QUARANTINED,
    )
    def quarantine(self):
        """any state but retired → quarantined: an incident response."""

    @transition(field=lifecycle, source=[Lifecycle.QUARANTINED, Lifecycle.REJECTED], target=Lifecycle.PENDING)
    def release(self):
        """quarantined | rejected → pending: a fresh admission is required."""

    @transition(
        field=lifecycle, source=[s for s in Lifecycle.values if s != Lifecycle.RETIRED], target=Lifecycle.RETIRED
    )
    def retire(self):
        """any → retired (terminal): identity and history stay."""


class NodeHold(models.Model):
    """One actor's cordon of one node: while any active hold exists, the node takes no new work.

    ``owner`` names the actor: ``user:<username>`` for people, ``drain:<drain id>`` for a drain's
    own hold, ``system:<name>`` for automation (``system:upgrade``…). An owner has at most one
    active hold per node; removing it stamps ``removed_at`` (the row stays as the record).
    Written only through ``maintenance.holds`` (place_hold / remove_hold), which keeps
    ``Node.cordoned`` in step. ``expires_at`` (optional) ends the hold by itself, at the next
    hold sweep.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="holds")
    owner = models.CharField(max_length=200)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_by_name = models.CharField(max_length=150, blank=True)
    removed_at = models.DateTimeField(null=True, blank=True)
    removed_by_name = models.CharField(max_length=150, blank=True)
    removal_reason = models.TextField(blank=True)
    forced = models.BooleanField(default=False, help_text="removed by an operator who did not own it")

    class Meta:
        ordering = ["created_at", "id"]
        constraints = [
            # One active hold per owner and node: a repeated cordon refreshes it, never stacks.
            models.UniqueConstraint(
                fields=["node", "owner"], condition=Q(removed_at__isnull=True), name="nodehold_one_active_per_owner"
            ),
        ]
        indexes = [
            # The hold sweep reads active holds that can expire.
            models.Index(
                fields=["expires_at"],
                name="nodehold_active_expiry",
                condition=Q(removed_at__isnull=True, expires_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"hold of {self.node_id} by {self.owner}"


def random_walk_key() -> int:
    """A new NodeResource row's ``walk_key``: uniform in [0, 2**31)."""
    return secrets.randbits(31)


class NodeResource(models.Model):
    """Capacity inventory of one resource on one node, in canonical units.

    ``allocatable = capacity - reserved`` (never below 0). ``allocated`` is the sum of the
    node's live leases, changed in the same transaction as each lease. ``free`` is
    ``max(0, allocatable - allocated)``; ``allocated > allocatable`` means overcommitted.
    """

    # No index of its own: the unique (node, name) index starts with the node and serves every
    # lookup by node. A second one cost an index entry more on each write of a row, and every
    # grant and release writes two or three rows (never HOT: the walk's index holds allocated).
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="resources", db_index=False)
    name = models.CharField(max_length=253)
    capacity = models.BigIntegerField(default=0)
    reserved = models.BigIntegerField(default=0)
    allocatable = models.BigIntegerField(default=0)
    allocated = models.BigIntegerField(default=0)
    # Whether the node has a NoSchedule or NoExecute taint: a copy of what ``node.taints`` says,
    # kept by database triggers (migration 0010) on every write of either row, whatever wrote it;
    # a value written here is replaced. Only so that the candidate search of a request without
    # tolerations can walk an index without the tainted nodes (``noderesource_free_untainted``).
    node_hard_tainted = models.BooleanField(default=False, editable=False)
    # The candidate walk's tie-break among nodes with the same free amount of this resource
    # (leases.placement_filter.candidate_query): random, and drawn per row, so that each
    # resource's walk meets equal nodes in an order of its own. Ordered by node id instead, every
    # resource's walk met them in one order: a cpu-only binpack filled the nodes at the head of
    # that order, and a GPU request's walk then read past all of them before the first with cpu
    # to spare (89 rows for a page of 16 on bench/devices.py's fleet after one round of each).
    walk_key = models.IntegerField(default=random_walk_key, editable=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "name"], name="noderesource_unique_name"),
            models.CheckConstraint(condition=Q(allocated__gte=0), name="noderesource_allocated_nonnegative"),
        ]
        indexes = [
            # Placement's candidate query: "nodes where <resource> has at least x free", best-first
            # (leases.placement.candidate_query) walks this index instead of scanning every node.
            models.Index(
                F("name"), F("allocatable") - F("allocated"), F("walk_key"), F("node"), name="noderesource_free"
            ),
            # The same for requests without tolerations: a binpack walk would otherwise read past
            # the tainted nodes, which gather at its front as tolerating work fills them.
            models.Index(
                F("name"),
                F("allocatable") - F("allocated"),
                F("walk_key"),
                F("node"),
                name="noderesource_free_untainted",
                condition=Q(node_hard_tainted=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.node_id}/{self.name}"

    @property
    def free(self) -> int:
        return max(0, self.allocatable - self.allocated)

    @property
    def overcommitted(self) -> bool:
        return self.allocated > self.allocatable
