"""Operations' problem codes: upgrades, pool operations, preemption notices, provider signatures
(nodepool.api.errors explains declaring and raising a code)."""

from nodepool.api.errors import FORBIDDEN, VALIDATION_ERROR, declare

DOC = "docs/pool-operations.md"

# Upgrades
UPGRADE_NOT_FOUND = declare("upgrade_not_found", 404, "Upgrade not found", doc=DOC)
UPGRADE_IN_PROGRESS = declare("upgrade_in_progress", 409, "Upgrade in progress", doc=DOC)
POOL_EMPTY = declare("pool_empty", 409, "Pool empty", doc=DOC)
INVALID_TARGET = declare("invalid_target", 400, "Invalid target", doc=DOC)
INVALID_MAX_UNAVAILABLE = declare("invalid_max_unavailable", 400, "Invalid max_unavailable", doc=DOC)
INVALID_REASON = declare("invalid_reason", 400, "Invalid reason", doc=DOC)
INVALID_DAYS = declare("invalid_days", 400, "Invalid days", doc=DOC)

# Canary overrides
INVALID_OVERRIDE = declare("invalid_override", 400, "Invalid canary override", doc=DOC)
CANARY_OVERRIDE_REQUIRED = declare("canary_override_required", 409, "Canary override required", doc=DOC)
NO_OTHER_CANARY_NODES = declare("no_other_canary_nodes", 409, "No other canary nodes", doc=DOC)

# Pool operations
INVALID_DISRUPTION_BUDGET = declare("invalid_disruption_budget", 400, "Invalid disruption budget", doc=DOC)
INVALID_REPAIR_RULE = declare("invalid_repair_rule", 400, "Invalid repair rule", doc=DOC)
INVALID_POOL_OPERATIONS = declare("invalid_pool_operations", 400, "Invalid pool operations", doc=DOC)

# Preemption notices and provider signatures
INVALID_DEADLINE = declare("invalid_deadline", 400, "Invalid deadline", doc=DOC)
DEADLINE_OUT_OF_RANGE = declare("deadline_out_of_range", 422, "Deadline out of range", doc=DOC)
INVALID_NODE_ID = declare("invalid_node_id", 400, "Invalid node id", doc=DOC)
POOL_NOT_SPOT = declare("pool_not_spot", 409, "Pool not spot", doc=DOC)
SIGNATURE_MISSING = declare("signature_missing", 403, "Signature missing", doc=DOC)
SIGNATURE_INVALID = declare("signature_invalid", 403, "Signature invalid", doc=DOC)
SIGNATURE_EXPIRED = declare("signature_expired", 403, "Signature expired", doc=DOC)
REPLAYED = declare("replayed", 403, "Delivery replayed", doc=DOC)

# Bulk actions by label selector (operations.bulk)
EMPTY_SELECTOR = declare("empty_selector", 400, "Empty selector", doc=DOC)
BULK_COUNT_MISMATCH = declare("bulk_count_mismatch", 409, "Bulk count mismatch", doc=DOC)
BULK_TOO_MANY = declare("bulk_too_many", 422, "Too many nodes for one bulk action", doc=DOC)

# Merged families (docs/api-contract.md, "Changelog of problem codes").
INVALID_UPGRADE = declare("invalid_upgrade", 400, doc=DOC, replaced_by=VALIDATION_ERROR)
PERMISSION_DENIED = declare("permission_denied", 403, doc=DOC, replaced_by=FORBIDDEN)
# invalid_deadline was also the 422 of a deadline out of range: now deadline_out_of_range.
INVALID_DEADLINE_RANGE = declare("invalid_deadline", 422, doc=DOC, replaced_by=DEADLINE_OUT_OF_RANGE)
