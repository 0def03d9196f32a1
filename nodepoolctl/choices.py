"""The API's enumerations that nodepoolctl's options offer, in one place.

nodepoolctl talks to the server over HTTP only (it does not import the server's code), so the
values are spelled here; tests/cli/test_nodepoolctl.py checks each against the server's choices
(``maintenance.choices.EvictionPolicy``, ``leases.choices.ReleaseOutcome``) so they cannot drift.
"""

from __future__ import annotations

# POST /nodes/{id}/drain "policy" (maintenance.choices.EvictionPolicy).
DRAIN_POLICIES = ("wait", "checkpoint", "terminate")
# POST /node-leases/{id}/release "outcome" (leases.choices.ReleaseOutcome).
RELEASE_OUTCOMES = ("succeeded", "failed", "cancelled", "preempted", "unknown")
