"""Verification records: admission checks, benchmarks and scheduled re-verifications."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django_fsm import ConcurrentTransitionMixin, FSMField, transition

from nodepool.fsm import SerializedFSMRefresh

from ..choices import BenchmarkStatus, CheckStatus, ReverificationState
from .nodes import Node, Pool


class AdmissionCheck(SerializedFSMRefresh, ConcurrentTransitionMixin, models.Model):
    """One named admission check of one admission attempt, with its outcome and timings.

    ``status`` is a state machine (django-fsm-2, protected): ``pending`` → ``passed`` | ``failed`` |
    ``skipped``, each once. fleet.admission writes an outcome with the set-based claim
    ``nodepool.fsm.move(<this check>, <verb>)`` (``WHERE status IN <the verb's sources>``), so a
    second run computing the same check writes nothing; :data:`OUTCOME_TRANSITIONS` names the verb
    of each outcome.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="admission_checks")
    attempt = models.PositiveIntegerField()
    name = models.CharField(max_length=64)
    status = FSMField(max_length=16, choices=CheckStatus.choices, default=CheckStatus.PENDING, protected=True)
    detail = models.TextField(blank=True)
    data = models.JSONField(default=dict, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["attempt", "id"]
        constraints = [models.UniqueConstraint(fields=["node", "attempt", "name"], name="admissioncheck_unique")]

    def __str__(self) -> str:
        return f"{self.name}#{self.attempt}: {self.status}"

    # --- transitions: memory only (fleet.admission claims them set-based and logs) -------------
    @transition(field=status, source=CheckStatus.PENDING, target=CheckStatus.PASSED)
    def succeed(self):
        """pending → passed: the check's pure function (or the benchmark's comparison) passed."""

    @transition(field=status, source=CheckStatus.PENDING, target=CheckStatus.FAILED)
    def fail(self):
        """pending → failed: the admission attempt will be rejected."""

    @transition(field=status, source=CheckStatus.PENDING, target=CheckStatus.SKIPPED)
    def skip(self):
        """pending → skipped: not applicable, or not run because another check failed."""


# The transition that records each outcome of a check (fleet.admission's ``Outcome.status``).
OUTCOME_TRANSITIONS = {CheckStatus.PASSED: "succeed", CheckStatus.FAILED: "fail", CheckStatus.SKIPPED: "skip"}


class Benchmark(SerializedFSMRefresh, ConcurrentTransitionMixin, models.Model):
    """A benchmark the control plane asked a node to run, identified by a nonce: for admission
    (its ``benchmark`` check) or for a scheduled re-verification (``Reverification.benchmark``).

    ``status`` is a state machine (django-fsm-2, protected): ``requested`` → ``completed`` (the
    node's figures arrived before the deadline) | ``timed_out`` (the deadline passed first). The
    deadline is each transition's condition; it depends on the caller's ``now``, so fleet.admission's
    claim (``nodepool.fsm.move``) checks it rather than a condition function reading the wall clock.
    """

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="benchmarks")
    nonce = models.CharField(max_length=64, unique=True)
    status = FSMField(max_length=16, choices=BenchmarkStatus.choices, default=BenchmarkStatus.REQUESTED, protected=True)
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

    # --- transitions: memory only (fleet.admission claims them set-based and logs) -------------
    @transition(field=status, source=BenchmarkStatus.REQUESTED, target=BenchmarkStatus.COMPLETED)
    def complete(self):
        """requested → completed: the node returned its figures before the deadline."""

    @transition(field=status, source=BenchmarkStatus.REQUESTED, target=BenchmarkStatus.TIMED_OUT)
    def time_out(self):
        """requested → timed_out: the deadline passed without an answer."""


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
