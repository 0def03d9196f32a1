"""Areas of the API, one OpenAPI tag each, so /api/docs/ groups operations as an operator thinks
of them. Plain data (no DRF import): settings read ``TAGS`` from here."""

from __future__ import annotations

import re

# (tag, description, path pattern under /api/v1/), first match wins; order is the docs' order.
AREAS = [
    ("pools", "Pools: policy, admission mode, reservations, heartbeat tuning.", r"^pools"),
    ("enrollment", "Bootstrap tokens, enrollment and node credentials.",
     r"^(bootstrap-tokens|node-enrollments|nodes/[^/]+/credentials)"),
    ("admission", "Admission checks and benchmarks.", r"^nodes/[^/]+/(admit|benchmarks)"),
    ("node agent", "What a node sends: heartbeats and detailed metrics (node credential).",
     r"^nodes/[^/]+/(heartbeats|metrics)"),
    ("maintenance", "Cordon, drain, quarantine, release, return to service, retire; drains, quarantines, "
     "disruption budgets.",
     r"^(nodes/[^/]+/(cordon|uncordon|drain|quarantine|release|return-to-service|retire)|drains|quarantines"
     r"|disruption-budgets)"),
    ("nodes", "Nodes: every state dimension, capability and capacity.", r"^nodes"),
    ("leases", "Placement, leases and fencing tokens, queued requests, consistency reports.",
     r"^(node-leases|lease-requests|fencing|lease-consistency-reports)"),
    ("shapes", "Named, versioned resource shapes for lease requests.", r"^shapes"),
    ("accounts", "Sign-in: log out everywhere, yourself or (operators) any user.", r"^(auth|users)/"),
]  # fmt: skip
TAGS = [{"name": tag, "description": description} for tag, description, _ in AREAS]
_AREA_PATTERNS = [(tag, re.compile(pattern)) for tag, _, pattern in AREAS]
_API_PREFIX = re.compile(r"^/api/v\d+/?")


def area_of(path: str) -> str:
    """The tag of an API path (``/api/v1/nodes/{id}/drain`` → ``maintenance``); paths of no known
    area are tagged by their first segment (``/api/v1/capacity/...`` → ``capacity``), the root ``api``."""
    rest = _API_PREFIX.sub("", path)
    for tag, pattern in _AREA_PATTERNS:
        if pattern.match(rest):
            return tag
    return rest.split("/", 1)[0] or "api"
