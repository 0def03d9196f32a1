"""What a node's owner reads of its re-verification (``GET /nodes/{id}/verification``): the
verification state, the failed run's evidence and next steps, and the history of finished runs
(split from fleet.reverification, issue 28 step 8)."""

from __future__ import annotations

from typing import Any

from . import trust
from .choices import Lifecycle, ReverificationState
from .models import Node, Reverification
from .reverification import NEXT_STEPS, history


def verification_view(node: Node) -> dict[str, Any]:
    """What the node's owner (and operators, clients) read at ``GET /nodes/{id}/verification``.

    ``{"verified": bool, "state": "verified"|"unverified"|"not_verified", "reason", "since", "code",
    "evidence", "next_steps", "last_check": {...} | None, "history": [...]}`` — never the next
    due time (docs/fleet.md: the node must not learn it in advance)."""
    runs = history(node.pk, limit=10)
    marked = trust.is_unverified(node)
    condition = next((c for c in node.conditions or [] if c.get("type") == trust.UNVERIFIED), None)
    failed = next((r for r in runs if r.state == ReverificationState.FAILED), None) if marked else None
    if marked:
        state = "unverified"
    elif node.verified and node.lifecycle not in (Lifecycle.PENDING, Lifecycle.ADMITTING, Lifecycle.REJECTED):
        state = "verified"
    else:
        state = "not_verified"
    return {
        "node": str(node.pk),
        "verified": state == "verified",
        "state": state,
        "since": condition.get("last_transition_time") if condition else None,
        "code": failed.code if failed else None,
        "reason": failed.reason if failed else (condition or {}).get("message") or None,
        "evidence": failed.evidence if failed else None,
        "next_steps": NEXT_STEPS.get(failed.code) if failed else None,
        "schedule": "on" if node.pool.reverification_period else "off",
        "history": [_run_view(r) for r in runs],
    }


def _run_view(run: Reverification) -> dict[str, Any]:
    return {
        "id": run.pk,
        "state": run.state,
        "code": run.code,
        "reason": run.reason,
        "mode": run.mode,
        "started_at": run.started_at.isoformat() if run.started_at else None,
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
        "expected": run.expected,
        "measured": run.measured,
    }
