"""Fleet's problem codes: pools, nodes, enrollment, credentials, heartbeats and renewals,
admission and benchmarks (nodepool.api.errors explains declaring and raising a code)."""

from nodepool.api.errors import declare

DOC = "docs/fleet.md"
CONTRACT = "docs/api-contract.md"
HEARTBEATS = "docs/heartbeats.md"

# Pools
POOL_NOT_FOUND = declare("pool_not_found", 404, "Pool not found", doc=DOC)
UNKNOWN_POOL = declare("unknown_pool", 400, "Unknown pool", doc=CONTRACT)
POOL_EXISTS = declare("pool_exists", 409, "Pool exists", doc=DOC)
POOL_HAS_NODES = declare("pool_has_nodes", 409, "Pool has nodes", doc=DOC)
INVALID_POOL_POLICY = declare("invalid_pool_policy", 400, "Invalid pool policy", doc=DOC)
INVALID_QUANTITY = declare("invalid_quantity", 400, "Invalid quantity", doc=CONTRACT)
RESERVED_LABEL = declare("reserved_label", 400, "Reserved label", doc=DOC)

# Nodes
NODE_NOT_FOUND = declare("node_not_found", 404, "Node not found", doc=DOC)
NODE_RETIRED = declare("node_retired", 410, "Node retired", doc=DOC)
NODE_QUARANTINED = declare("node_quarantined", 409, "Node quarantined", doc=DOC)

# Bootstrap tokens and enrollment
BOOTSTRAP_TOKEN_NOT_FOUND = declare("bootstrap_token_not_found", 404, "Bootstrap token not found", doc=DOC)
BOOTSTRAP_TOKEN_INVALID = declare("bootstrap_token_invalid", 403, "Bootstrap token invalid", doc=DOC)
BOOTSTRAP_TOKEN_REVOKED = declare("bootstrap_token_revoked", 403, "Bootstrap token revoked", doc=DOC)
BOOTSTRAP_TOKEN_EXPIRED = declare("bootstrap_token_expired", 403, "Bootstrap token expired", doc=DOC)
BOOTSTRAP_TOKEN_EXHAUSTED = declare("bootstrap_token_exhausted", 403, "Bootstrap token exhausted", doc=DOC)
BOOTSTRAP_TOKEN_WRONG_POOL = declare("bootstrap_token_wrong_pool", 403, "Bootstrap token for another pool", doc=DOC)
BOOTSTRAP_TOKEN_WRONG_NODE = declare("bootstrap_token_wrong_node", 403, "Bootstrap token for another node", doc=DOC)
UNKNOWN_NODE = declare("unknown_node", 400, "Unknown node", doc=DOC)
NODE_POOL_MISMATCH = declare("node_pool_mismatch", 400, "Node in another pool", doc=DOC)
INVALID_EXPIRY = declare("invalid_expiry", 400, "Invalid expiry", doc=DOC)
INVALID_MAX_USES = declare("invalid_max_uses", 400, "Invalid max_uses", doc=DOC)
OWNER_REQUIRED = declare("owner_required", 400, "Owner required", doc=DOC)

# Credentials
CREDENTIAL_SUPERSEDED = declare("credential_superseded", 409, "Credential superseded", doc=DOC)
ROTATION_THROTTLED = declare("rotation_throttled", 429, "Rotation throttled", doc=DOC)

# Heartbeats and renewals
CONCURRENT_HEARTBEAT = declare("concurrent_heartbeat", 409, "Concurrent heartbeat", doc=HEARTBEATS)
CONCURRENT_RENEWAL = declare("concurrent_renewal", 409, "Concurrent renewal", doc=HEARTBEATS)
TOO_MANY_REQUESTS = declare("too_many_requests", 429, "Too many node messages", doc=CONTRACT)
HEARTBEAT_LIMIT_EXCEEDED = declare("heartbeat_limit_exceeded", 422, "Heartbeat limit exceeded", doc=HEARTBEATS)
METRICS_LIMIT_EXCEEDED = declare("metrics_limit_exceeded", 422, "Metrics limit exceeded", doc=HEARTBEATS)

# Devices
DEVICE_NOT_FOUND = declare("device_not_found", 404, "Device not found", doc=DOC)
DEVICE_NOT_HELD = declare("device_not_held", 409, "Device not held", doc=DOC)
INVALID_TAINT = declare("invalid_taint", 400, "Invalid device taint", doc=DOC)
TAINT_NOT_FOUND = declare("taint_not_found", 409, "Device taint not found", doc=DOC)

# Admission and benchmarks
BENCHMARK_NOT_FOUND = declare("benchmark_not_found", 404, "Benchmark not found", doc=DOC)
BENCHMARK_ALREADY_COMPLETED = declare("benchmark_already_completed", 409, "Benchmark already completed", doc=DOC)
BENCHMARK_EXPIRED = declare("benchmark_expired", 410, "Benchmark expired", doc=DOC)
