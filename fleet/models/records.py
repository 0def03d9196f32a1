"""One-row sweep and clock memories, the latest metrics report, and per-day reliability records."""

from __future__ import annotations

from django.db import models

from .nodes import Node


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
