"""Hot-path counters of node traffic (prometheus_client; exported by the project's /metrics).

``nodepool_heartbeats_total{kind, outcome}``: every renewal and status report answered, by
``kind`` (``renewal`` | ``status_report``) and ``outcome`` (the response's ``code``: ``applied``,
``duplicate_sequence``, ``stale_sequence``, ``stale_incarnation``, ``status_report_required``,
or the problem code of a refusal: ``too_many_requests``, ``node_retired``,
``authentication_failed``, ``forbidden``, ``validation_error``, ``payload_too_large``…). Both
labels have a small fixed set of values (no ids: Prometheus naming guide).

``nodepool_renewal_prescribed_delay_seconds``: the delay each answer prescribed to the next
renewal (``next_renewal_in``, aimed at the node's slot: within [0.6, 1.4] x the interval told).
A fleet on its slots is told about the interval; a herd being spread shows as mass near 0.6 and
1.4 x the interval, and its ``_count`` rate is the renewals answered per second.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

RENEWAL = "renewal"
STATUS_REPORT = "status_report"

HEARTBEATS = Counter(
    "nodepool_heartbeats",
    "Node renewals and status reports answered, by kind and outcome code.",
    ["kind", "outcome"],
)

# Finished re-verifications by pool and outcome (passed | failed): a rising failed rate is
# deverifications (fleet.reverification). Bounded labels: pools, two outcomes.
REVERIFICATIONS = Counter(
    "nodepool_node_reverifications",
    "Scheduled node re-verifications finished, by pool and outcome (failed: the node was deverified).",
    ["pool", "outcome"],
)

_children: dict[tuple[str, str], object] = {}


def count(kind: str, outcome: str) -> None:
    """Add one to ``nodepool_heartbeats_total{kind, outcome}`` (children cached: no label lookup
    on the hot path after the first of each pair)."""
    child = _children.get((kind, outcome))
    if child is None:
        child = _children[(kind, outcome)] = HEARTBEATS.labels(kind=kind, outcome=outcome)
    child.inc()


DELAY_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)
PRESCRIBED_DELAY = Histogram(
    "nodepool_renewal_prescribed_delay_seconds",
    "Delay to the next renewal prescribed by each answer (next_renewal_in), in seconds.",
    buckets=DELAY_BUCKETS,
)


def prescribed(delay: float) -> None:
    """Observe one prescribed delay (seconds) in ``nodepool_renewal_prescribed_delay_seconds``."""
    PRESCRIBED_DELAY.observe(delay)
