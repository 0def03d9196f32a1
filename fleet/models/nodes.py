"""Fleet models: pools, nodes and their identity, capacity inventory, credentials, admission.

A node's state is several independent dimensions (docs/foundation.md, "The state model"): ``lifecycle`` (FSM, only
transitions change it), ``liveness`` (from the control plane's receipt times), ``ready`` (what
the node says), ``health`` (the control plane's judgement of conditions) and capacity
(:class:`NodeResource`). Nothing here stores a single "online" flag; ``schedulable`` is derived.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django_fsm import ConcurrentTransitionMixin, FSMField, transition

from nodepool.fsm import SerializedFSMRefresh

from .. import event_types
from ..choices import (
    ActorType,
    AdmissionMode,
    BenchmarkStatus,
    CheckStatus,
    DeviceHealth,
    Health,
    Lifecycle,
    Liveness,
    PoolKind,
    ReverificationBusyPolicy,
    ReverificationState,
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


class NodeResource(models.Model):
    """Capacity inventory of one resource on one node, in canonical units.

    ``allocatable = capacity - reserved`` (never below 0). ``allocated`` is the sum of the
    node's live leases, changed in the same transaction as each lease. ``free`` is
    ``max(0, allocatable - allocated)``; ``allocated > allocatable`` means overcommitted.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="resources")
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

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "name"], name="noderesource_unique_name"),
            models.CheckConstraint(condition=Q(allocated__gte=0), name="noderesource_allocated_nonnegative"),
        ]
        indexes = [
            # Placement's candidate query: "nodes where <resource> has at least x free", best-first
            # (leases.placement.candidate_query) walks this index instead of scanning every node.
            models.Index(F("name"), F("allocatable") - F("allocated"), F("node"), name="noderesource_free"),
            # The same for requests without tolerations: a binpack walk would otherwise read past
            # the tainted nodes, which gather at its front as tolerating work fills them.
            models.Index(
                F("name"),
                F("allocatable") - F("allocated"),
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


class Device(models.Model):
    """One accelerator (or other ``<domain>/<name>`` device) of a node: a GPU, a MIG instance…

    ``device_id`` is the stable id the node reports (the GPU UUID; a MIG instance has its own
    ``MIG-…`` UUID). The attribute columns hold what the node last reported (declared);
    ``verified`` is the snapshot accepted at admission or by an operator's "verify device"
    (``verified_at`` set), ``measured`` what a benchmark found. A device is **allocatable** when it
    is verified, not retired, not held, its health is not unhealthy/missing and it carries no
    ``NoSchedule``/``NoExecute`` taint (:meth:`allocatable`); the node's count resource of the
    device's type is the number of allocatable devices (fleet.devices.sync_counts).

    ``taints``: ``[{"key", "value", "effect", "reason", "source": "auto"|"operator", "added_at"}]``
    (Kubernetes semantics, KEP-5055's device taints); ``hard_tainted`` mirrors whether one of them
    is NoSchedule/NoExecute. A replaced GPU is a new row; the old one is retired with its history.
    The partial unique index ``device_one_live_id`` makes a device id belong to at most one
    non-retired row in the whole fleet (fleet.devices defines the handover between nodes).
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="devices")
    device_id = models.CharField(max_length=200)
    type = models.CharField(max_length=253)
    index = models.PositiveIntegerField(default=0)
    model = models.CharField(max_length=200, blank=True)
    memory_bytes = models.BigIntegerField(null=True, blank=True)
    mig_profile = models.CharField(max_length=64, blank=True)
    parent_device_id = models.CharField(max_length=200, blank=True, help_text="a MIG instance's parent GPU id")
    pci_bus_id = models.CharField(max_length=64, blank=True)
    numa_node = models.IntegerField(null=True, blank=True)
    interconnect_group = models.CharField(max_length=128, blank=True)
    serial = models.CharField(max_length=128, blank=True)
    driver_version = models.CharField(max_length=64, blank=True)
    cuda_version = models.CharField(max_length=32, blank=True)
    declared = models.JSONField(default=dict, blank=True)
    measured = models.JSONField(default=dict, blank=True)
    verified = models.JSONField(default=dict, blank=True)
    verified_at = models.DateTimeField(null=True, blank=True)
    verified_by = models.CharField(max_length=150, blank=True)
    health = models.CharField(max_length=16, choices=DeviceHealth.choices, default=DeviceHealth.UNKNOWN)
    health_detail = models.JSONField(default=dict, blank=True)
    last_fault_at = models.DateTimeField(null=True, blank=True)
    # Fault times within the flap window (ISO 8601, newest last): too many and the device is held.
    recent_faults = models.JSONField(default=list, blank=True)
    held = models.BooleanField(default=False, help_text="held out after flapping until an operator releases it")
    taints = models.JSONField(default=list, blank=True)
    hard_tainted = models.BooleanField(default=False)
    # Whether a live lease holds the device, or a MIG instance of it (a whole GPU with a slice in
    # use is not free either). Written by leases.devices in the same transaction as the claim or
    # release it mirrors, so that placement and the 409 read "free" as a column of the device
    # row instead of probing the live holds per device (leases.devices.device_rule_sql).
    claimed = models.BooleanField(default=False, editable=False)
    fault_boot_id = models.CharField(max_length=64, blank=True, help_text="the node's boot id at the last fault")
    first_seen_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()
    retired_at = models.DateTimeField(null=True, blank=True)
    retired_reason = models.TextField(blank=True)

    class Meta:
        ordering = ["node", "type", "index", "device_id"]
        constraints = [
            # A device id is live on one row at most, fleet-wide (identity across the fleet).
            models.UniqueConstraint(
                fields=["device_id"], condition=Q(retired_at__isnull=True), name="device_one_live_id"
            ),
        ]
        indexes = [
            # Placement and the grant read a node's live devices of a type.
            models.Index(fields=["node", "type"], name="device_live_by_node", condition=Q(retired_at__isnull=True)),
        ]
        permissions = [("operate_device", "Can verify, taint and release devices")]

    def __str__(self) -> str:
        return f"{self.type} {self.device_id} ({self.node_id})"

    @property
    def allocatable(self) -> bool:
        return (
            self.verified_at is not None
            and self.retired_at is None
            and not self.held
            and not self.hard_tainted
            and self.health not in (DeviceHealth.UNHEALTHY, DeviceHealth.MISSING)
        )


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


class AdmissionCheck(models.Model):
    """One named admission check of one admission attempt, with its outcome and timings."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="admission_checks")
    attempt = models.PositiveIntegerField()
    name = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=CheckStatus.choices, default=CheckStatus.PENDING)
    detail = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["attempt", "id"]
        constraints = [models.UniqueConstraint(fields=["node", "attempt", "name"], name="admissioncheck_unique")]

    def __str__(self) -> str:
        return f"{self.name}#{self.attempt}: {self.status}"


class Benchmark(models.Model):
    """A benchmark the control plane asked a node to run, identified by a nonce: for admission
    (its ``benchmark`` check) or for a scheduled re-verification (``Reverification.benchmark``)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="benchmarks")
    nonce = models.CharField(max_length=64, unique=True)
    status = models.CharField(max_length=16, choices=BenchmarkStatus.choices, default=BenchmarkStatus.REQUESTED)
    requested_at = models.DateTimeField()
    deadline = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    result = models.JSONField(default=dict, blank=True)
    # What the node may use for it, ``{resource: canonical int}`` (cpu millicores, memory bytes);
    # empty: the whole machine. A re-verification of a busy node limits it to the free capacity
    # (fleet.reverification), so that it never takes capacity from running leases.
    limits = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-requested_at"]

    def __str__(self) -> str:
        return f"{self.node_id}/{self.nonce}: {self.status}"


class Reverification(SerializedFSMRefresh, models.Model):
    """One scheduled re-verification of a node (fleet.reverification): its due time, its run and
    its outcome with the evidence. The node's re-verification history is its rows, newest first.

    ``due_at`` is drawn server-side and never rendered to the node. ``mode``: ``full`` (the
    benchmark measured the whole machine against ``verified``) or ``free`` (a busy node measured
    only its free capacity, ``expected`` = allocatable − allocated). ``expected`` and
    ``measured`` are ``{resource: canonical int}`` (cpu millicores, memory bytes). ``code`` is the
    outcome's stable code (``passed``, ``measured_below_verified``, ``inventory_mismatch``,
    ``attestation_failed``, ``no_answer``, ``node_left_service``, ``schedule_off``) and
    ``evidence`` its detail: ``{"ratios": {resource: measured/expected}, "shortfalls": [...],
    "inventory": [{"device_id", "field", "verified", "reported"}], "attestation": str}``.
    At most one run per node is open (scheduled or running): the constraint
    ``reverification_one_open_per_node``, which also keeps two sweeps from both scheduling one.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="reverifications")
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="+")
    state = FSMField(
        max_length=12, choices=ReverificationState.choices, default=ReverificationState.SCHEDULED, protected=True
    )
    due_at = models.DateTimeField()
    postponed = models.PositiveIntegerField(default=0, help_text="times the run waited for an idle node")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    benchmark = models.ForeignKey(Benchmark, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    mode = models.CharField(max_length=8, blank=True)
    expected = models.JSONField(default=dict, blank=True)
    measured = models.JSONField(default=dict, blank=True)
    code = models.CharField(max_length=32, blank=True)
    reason = models.TextField(blank=True)
    evidence = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-due_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["node"],
                condition=Q(state__in=[ReverificationState.SCHEDULED, ReverificationState.RUNNING]),
                name="reverification_one_open_per_node",
            ),
        ]
        indexes = [
            # The sweep reads scheduled runs that are due.
            models.Index(
                fields=["due_at"], name="reverification_due", condition=Q(state=ReverificationState.SCHEDULED)
            ),
            # The reliability record and reconciliation read a node's history by time.
            models.Index(fields=["node", "-finished_at"], name="reverification_node_history"),
        ]

    def __str__(self) -> str:
        return f"re-verification of {self.node_id} due {self.due_at}: {self.state}"

    # --- transitions: memory only (fleet.reverification saves and logs) ----------------------
    @transition(field=state, source=ReverificationState.SCHEDULED, target=ReverificationState.RUNNING)
    def start(self):
        """scheduled → running: a sweep claimed the due run."""

    @transition(field=state, source=ReverificationState.RUNNING, target=ReverificationState.PASSED)
    def confirm(self):
        """running → passed: measurement within tolerance, inventory as verified."""

    @transition(field=state, source=ReverificationState.RUNNING, target=ReverificationState.FAILED)
    def fail(self):
        """running → failed: the node is deverified."""

    @transition(
        field=state,
        source=[ReverificationState.SCHEDULED, ReverificationState.RUNNING],
        target=ReverificationState.CANCELLED,
    )
    def cancel(self):
        """scheduled | running → cancelled: the node left service or the schedule changed."""


class LivenessSweepState(models.Model):
    """The liveness sweep's own memory: one row (``pk=1``), locked by each sweep run.

    ``last_run_at`` detects the control plane's own outage or a jump of its clock: when the gap
    since the previous run exceeds a pool's grace, ``recovered_at`` is set to the run that noticed
    it and every liveness threshold counts from there (fleet.liveness). ``guarded_groups`` holds the
    pools/zones where lease loss is withheld because too much of them went silent at once.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    last_run_at = models.DateTimeField(null=True, blank=True)
    recovered_at = models.DateTimeField(null=True, blank=True)
    gap_seconds = models.FloatField(default=0.0)
    guarded_groups = models.JSONField(default=dict, blank=True)
    # Guards released recently: {key: {"released_at": iso}}. Nodes of a released group get a fresh
    # loss window from the release (fleet.liveness); a guard engaged again drops its entry.
    guard_releases = models.JSONField(default=dict, blank=True)
    last_result = models.JSONField(default=dict, blank=True)

    def __str__(self) -> str:
        return f"liveness sweep (last run {self.last_run_at})"


class ControlPlaneClock(models.Model):
    """The control plane's own clock memory: one row (``pk=1``), see :mod:`fleet.clock`.

    ``observed_at`` is the wall time of the last observation by a periodic job; a forward move
    beyond ``NODEPOOL["CLOCK_JUMP_THRESHOLD"]`` is a detected gap, paused for every deadline.
    ``paused_seconds`` is the total paused so far (control-plane time = wall time − it).
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    observed_at = models.DateTimeField(null=True, blank=True)
    paused_seconds = models.FloatField(default=0.0)
    last_gap_started_at = models.DateTimeField(null=True, blank=True)
    last_gap_ended_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"control-plane clock (observed {self.observed_at}, paused {self.paused_seconds:.0f}s)"


class NodeMetrics(models.Model):
    """The latest detailed metrics a node sent (``POST /nodes/{id}/metrics``), kept apart from
    heartbeats so that heartbeats stay small. One row per node, overwritten on each report."""

    node = models.OneToOneField(Node, on_delete=models.CASCADE, primary_key=True, related_name="metrics")
    received_at = models.DateTimeField()
    observed_at = models.DateTimeField(null=True, blank=True)
    metrics = models.JSONField(default=dict)

    def __str__(self) -> str:
        return f"metrics of {self.node_id} at {self.received_at}"


class FleetState(models.Model):
    """The fleet-wide aggregates behind ``/metrics`` and the admin fleet overview: one row (``pk=1``).

    Computed every ``NODEPOOL["FLEET_STATE_INTERVAL"]`` seconds by the beat task
    ``fleet.refresh_fleet_state`` (:mod:`fleet.fleet_state`), so that a scrape or a page view reads
    one row instead of scanning every node (capability drift and usage need JSON over each node).
    ``figures`` holds rows keyed by pool pk; ``computed_at`` is when the computation started.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1, editable=False)
    computed_at = models.DateTimeField(null=True, blank=True)
    duration_seconds = models.FloatField(default=0.0)
    figures = models.JSONField(default=dict, blank=True)

    def __str__(self) -> str:
        return f"fleet state (computed {self.computed_at})"


class NodeReliabilityDay(models.Model):
    """One node's reliability figures for one UTC day (fleet.reliability, docs/fleet.md "Reliability").

    The lease counters (``leases_<outcome>``, :class:`fleet.choices.LeaseOutcome`) are incremented
    in the transaction that ends each lease (leases.reliability); ``observed_seconds``,
    ``up_seconds`` and ``device_faults`` are rewritten by the rollup task from the liveness and
    device events of that day while they are still within the event retention. Rows outlive the
    events (``RELIABILITY_RETENTION_DAYS``), so the 7- and 30-day windows are sums over these rows.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="reliability_days")
    day = models.DateField(help_text="UTC day")
    observed_seconds = models.PositiveIntegerField(default=0, help_text="seconds of the day the node existed")
    up_seconds = models.PositiveIntegerField(default=0, help_text="seconds of the day the node was alive or stale")
    leases_completed = models.PositiveIntegerField(default=0)
    leases_lost_unreachable = models.PositiveIntegerField(default=0)
    leases_lost_unreported = models.PositiveIntegerField(default=0)
    leases_lost_on_restart = models.PositiveIntegerField(default=0)
    leases_failed_after_restart = models.PositiveIntegerField(default=0)
    leases_revoked_device_fault = models.PositiveIntegerField(default=0)
    leases_revoked_quarantine = models.PositiveIntegerField(default=0)
    device_faults = models.JSONField(default=dict, blank=True, help_text="{device id: faults that day}")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "day"], name="nodereliabilityday_one_per_day")]
        # The windows' sums and the retention prune read by day.
        indexes = [models.Index(fields=["day"], name="nodereliabilityday_by_day")]

    def __str__(self) -> str:
        return f"reliability of {self.node_id} on {self.day}"
