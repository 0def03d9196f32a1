"""Maintenance's problem codes: drains, holds, disruption budgets, node actions
(nodepool.api.errors explains declaring and raising a code)."""

from nodepool.api.errors import declare

DOC = "docs/maintenance.md"

DRAIN_NOT_FOUND = declare("drain_not_found", 404, "Drain not found", doc=DOC)
DRAIN_ACTIVE = declare("drain_active", 409, "Drain active", doc=DOC)
DRAIN_NOT_ACTIVE = declare("drain_not_active", 409, "Drain not active", doc=DOC)
DEADLINE_IN_PAST = declare("deadline_in_past", 422, "Deadline in the past", doc=DOC)
DEADLINE_TOO_FAR = declare("deadline_too_far", 422, "Deadline too far", doc=DOC)
NODE_HAS_LIVE_LEASES = declare("node_has_live_leases", 409, "Node has live leases", doc=DOC)
INVALID_HOLD = declare("invalid_hold", 422, "Invalid hold", doc=DOC)
HOLD_NOT_FOUND = declare("hold_not_found", 409, "Hold not found", doc=DOC)
HOLD_OWNED_BY_OTHER = declare("hold_owned_by_other", 403, "Hold owned by another actor", doc=DOC)
FORCE_REQUIRES_OPERATOR = declare("force_requires_operator", 403, "Force requires an operator", doc=DOC)
BUDGET_NOT_FOUND = declare("budget_not_found", 404, "Disruption budget not found", doc=DOC)
