"""A node's devices: one row per accelerator (or other ``<domain>/<name>`` device) it reports."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from ..choices import DeviceHealth
from .nodes import Node


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
    # row instead of probing the live holds per device (leases.sql.devices.device_rule_sql).
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
