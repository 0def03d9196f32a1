"""Fleet models: pools, nodes and their identity, capacity inventory, credentials, admission.

A node's state is several independent dimensions (docs/foundation.md, "The state model"):
``lifecycle`` (FSM, only transitions change it), ``liveness`` (from the control plane's receipt
times), ``ready`` (what the node says), ``health`` (the control plane's judgement of conditions)
and capacity (:class:`NodeResource`). Nothing here stores a single "online" flag;
``schedulable`` is derived.

One submodule per seam (nodes, devices, events, credentials, verification, records); every model is
re-exported here, so callers write ``from fleet.models import Node`` and Django finds each model
through this package.
"""

from .credentials import BootstrapToken, NodeCredential
from .devices import Device
from .events import Event, NodeEvent
from .nodes import DEFAULT_DEGRADED_CONDITIONS, DEFAULT_UNHEALTHY_CONDITIONS, Node, NodeHold, NodeResource, Pool
from .records import ControlPlaneClock, FleetState, LivenessSweepState, NodeMetrics, NodeReliabilityDay
from .verification import OUTCOME_TRANSITIONS, AdmissionCheck, Benchmark, Reverification

__all__ = [
    "DEFAULT_DEGRADED_CONDITIONS",
    "DEFAULT_UNHEALTHY_CONDITIONS",
    "OUTCOME_TRANSITIONS",
    "AdmissionCheck",
    "Benchmark",
    "BootstrapToken",
    "ControlPlaneClock",
    "Device",
    "Event",
    "FleetState",
    "LivenessSweepState",
    "Node",
    "NodeCredential",
    "NodeEvent",
    "NodeHold",
    "NodeMetrics",
    "NodeReliabilityDay",
    "NodeResource",
    "Pool",
    "Reverification",
]
