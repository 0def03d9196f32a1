"""Leases' problem codes: lease requests, the grant, fencing, the queue (nodepool.api.errors
explains declaring and raising a code)."""

from nodepool.api.errors import VALIDATION_ERROR, declare

DOC = "docs/leases.md"
CONTRACT = "docs/api-contract.md"

# The request body (leases.spec)
EMPTY_REQUEST = declare("empty_request", 400, "Empty request", doc=DOC)
INVALID_SELECTOR = declare("invalid_selector", 400, "Invalid node selector", doc=DOC)
INVALID_AFFINITY = declare("invalid_affinity", 400, "Invalid affinity", doc=DOC)
INVALID_TOLERATION = declare("invalid_toleration", 400, "Invalid toleration", doc=DOC)
INVALID_SPREAD = declare("invalid_spread", 400, "Invalid spread", doc=DOC)
UNKNOWN_RESOURCE = declare("unknown_resource", 400, "Unknown resource", doc=DOC)
UNKNOWN_SHAPE = declare("unknown_shape", 400, "Unknown shape", doc=DOC)
INVALID_DEVICE_REQUEST = declare("invalid_device_request", 400, "Invalid device request", doc=DOC)
INVALID_DEVICE_CONSTRAINT = declare("invalid_device_constraint", 400, "Invalid device constraint", doc=DOC)
INVALID_NODE_CONSTRAINT = declare("invalid_node_constraint", 400, "Invalid node constraint", doc=DOC)
UNKNOWN_DEVICE_TYPE = declare("unknown_device_type", 400, "Unknown device type", doc=DOC)
INVALID_COLOCATION = declare("invalid_colocation", 400, "Invalid device colocation", doc=DOC)
INVALID_COUNT = declare("invalid_count", 400, "Invalid count", doc="docs/observability.md")
# Merged into validation_error (docs/api-contract.md, "Changelog of problem codes").
INVALID_REQUEST = declare("invalid_request", 400, doc=DOC, replaced_by=VALIDATION_ERROR)

# The grant
UNSCHEDULABLE = declare("unschedulable", 409, "Unschedulable", doc=DOC)
IMPOSSIBLE_REQUEST = declare("impossible_request", 422, "Impossible request", doc=DOC)
IDEMPOTENCY_KEY_REUSED = declare("idempotency_key_reused", 422, "Idempotency key reused", doc=DOC)
WORKLOAD_HAS_LIVE_LEASE = declare("workload_has_live_lease", 409, "Workload has a live lease", doc=DOC)

# Leases and fencing
LEASE_NOT_FOUND = declare("lease_not_found", 404, "Lease not found", doc=DOC)
LEASE_SUPERSEDED = declare("lease_superseded", 409, "Lease superseded", doc=CONTRACT)
STALE_FENCING_TOKEN = declare("stale_fencing_token", 409, "Stale fencing token", doc=CONTRACT)
STALE_INCARNATION = declare("stale_incarnation", 409, "Stale incarnation", doc=CONTRACT)
LEASE_ENDED = declare("lease_ended", 410, "Lease ended", doc=CONTRACT)
LEASE_EXPIRED = declare("lease_expired", 410, "Lease expired", doc=CONTRACT)

# The queue
LEASE_REQUEST_NOT_FOUND = declare("lease_request_not_found", 404, "Lease request not found", doc=DOC)
LEASE_REQUEST_NOT_PENDING = declare("lease_request_not_pending", 409, "Lease request not pending", doc=DOC)
