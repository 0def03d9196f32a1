"""The marketplace's problem codes: usage records, statements, prices, appeals, owner settings
(nodepool.api.errors explains declaring and raising a code)."""

from nodepool.api.errors import VALIDATION_ERROR, declare

DOC = "docs/marketplace.md"

USAGE_RECORD_NOT_FOUND = declare("usage_record_not_found", 404, "Usage record not found", doc=DOC)
USAGE_NOT_DISPUTED = declare("usage_not_disputed", 409, "Usage not disputed", doc=DOC)
INVALID_DECISION = declare("invalid_decision", 400, "Invalid decision", doc=DOC)
INVALID_DECIMAL = declare("invalid_decimal", 400, "Invalid decimal", doc=DOC)
STATEMENT_NOT_FOUND = declare("statement_not_found", 404, "Statement not found", doc=DOC)
STATEMENT_FINAL = declare("statement_final", 409, "Statement final", doc=DOC)
PERIOD_NOT_OVER = declare("period_not_over", 409, "Period not over", doc=DOC)
STATEMENT_HAS_UNRECONCILED_LINES = declare(
    "statement_has_unreconciled_lines", 409, "Statement has unreconciled lines", doc=DOC
)
UNKNOWN_EXPORT_FORMAT = declare("unknown_export_format", 404, "Unknown export format", doc=DOC)
PRICE_VERSION_EXISTS = declare("price_version_exists", 409, "Price version exists", doc=DOC)
CURRENCY_MISMATCH = declare("currency_mismatch", 409, "Currency mismatch", doc=DOC)
INVALID_CURRENCY = declare("invalid_currency", 400, "Invalid currency", doc=DOC)
SETTLEMENT_WINDOW_TOO_SHORT = declare("settlement_window_too_short", 400, "Settlement window too short", doc=DOC)
OWNER_NOT_FOUND = declare("owner_not_found", 404, "Owner not found", doc=DOC)
RULE_NOT_FOUND = declare("rule_not_found", 404, "Quarantine rule not found", doc=DOC)
NOT_QUARANTINED = declare("not_quarantined", 404, "Never quarantined", doc=DOC)
NODE_NOT_QUARANTINED = declare("node_not_quarantined", 409, "Node not quarantined", doc=DOC)
APPEAL_NOT_FOUND = declare("appeal_not_found", 404, "Appeal not found", doc=DOC)
APPEAL_ALREADY_OPEN = declare("appeal_already_open", 409, "Appeal already open", doc=DOC)
APPEAL_NOT_OPEN = declare("appeal_not_open", 409, "Appeal not open", doc=DOC)
INVALID_OUTCOME = declare("invalid_outcome", 400, "Invalid outcome", doc=DOC)

# Pool periods, payouts, payout holds, line appeals
APPROVAL_BY_REQUESTER = declare("approval_by_requester", 403, doc=DOC)
HOLD_RELEASED = declare("hold_released", 409, doc=DOC)
LINE_APPEAL_EXISTS = declare("line_appeal_exists", 409, doc=DOC)
LINE_APPEAL_NOT_FOUND = declare("line_appeal_not_found", 404, doc=DOC)
LINE_NOT_FOUND = declare("line_not_found", 404, doc=DOC)
LINE_PAID = declare("line_paid", 409, doc=DOC)
MISMATCH_NOT_FOUND = declare("mismatch_not_found", 404, doc=DOC)
MISMATCH_RESOLVED = declare("mismatch_resolved", 409, doc=DOC)
NOTHING_TO_PAY = declare("nothing_to_pay", 409, doc=DOC)
PAYOUT_EXISTS = declare("payout_exists", 409, doc=DOC)
PAYOUT_HOLD_NOT_FOUND = declare("payout_hold_not_found", 404, doc=DOC)
PAYOUT_NOT_FOUND = declare("payout_not_found", 404, doc=DOC)
PERIOD_NOT_RECONCILED = declare("period_not_reconciled", 409, doc=DOC)
POOL_PERIOD_NOT_FOUND = declare("pool_period_not_found", 404, doc=DOC)
STATEMENT_NOT_FINAL = declare("statement_not_final", 409, doc=DOC)
STATEMENT_ON_HOLD = declare("statement_on_hold", 409, doc=DOC)
PAYOUT_IMPORT_INVALID = declare("payout_import_invalid", 400, "Invalid payout import", doc=DOC)
PAYOUT_IMPORT_CONFLICT = declare("payout_import_conflict", 409, "Payout import conflicts", doc=DOC)

# Merged into validation_error (docs/api-contract.md, "Changelog of problem codes").
INVALID_FIELD = declare("invalid_field", 400, doc=DOC, replaced_by=VALIDATION_ERROR)
