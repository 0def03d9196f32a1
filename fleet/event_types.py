"""The event types of the one event table (``fleet.models.NodeEvent``), each declared by the app
whose words it is.

The table is general (subject, node, pool, lease, workload) and lives in ``fleet``, the lowest
app; its vocabulary does not: each app declares its own types in its ``event_types`` module
(``leases/event_types.py``: ``lease``, ``checkpoint``; ``maintenance``: ``drain``, ``quarantine``,
``hold``; ``operations``: ``upgrade``, ``scale``, ``preemption``; ``marketplace``: ``usage``,
``statement``, ``appeal``), imported from its ``AppConfig.ready()``. The field's choices, the
events API's ``type`` filter and the admin read this registry, so a new type needs no change in
``fleet`` and no migration. The stored values never change (they are what clients filter on).

Declare one::

    # maintenance/event_types.py
    from fleet.event_types import declare

    DRAIN = declare("drain", "drain")

and record it by reference: ``record_event(node, DRAIN, actor, …)``.
"""

from __future__ import annotations

import sys

_TYPES: dict[str, EventType] = {}


class EventType(str):
    """A declared event type: the stored value (a ``str``), plus ``label`` (for people), ``app``
    (the declaring package), ``private`` (read only by the node's owner and operators: it
    carries the owner's words or money, fleet.api.events) and ``owner_key`` (for events of no
    node, such as a payout's: the member of ``data`` holding the user id of the owner who reads
    them too; empty: none)."""

    label: str
    app: str
    private: bool
    owner_key: str

    def __new__(cls, value: str, label: str, *, app: str, private: bool = False, owner_key: str = ""):
        obj = super().__new__(cls, value)
        obj.label, obj.app, obj.private, obj.owner_key = label, app, private, owner_key
        return obj

    @property
    def value(self) -> str:  # as TextChoices members have it
        return str(self)

    def __reduce__(self):
        return (_restore, (str(self),))


def _restore(value: str) -> str:
    return _TYPES.get(value, value)


def declare(value: str, label: str, *, private: bool = False, owner_key: str = "") -> EventType:
    """Declare the event type ``value`` (at most 32 characters, stored as is) with ``label``.

    ``private`` types are hidden from lease clients (fleet.api.events). ``owner_key``: events of
    this type that belong to no node are read by the owner whose user id is ``data[owner_key]``
    (a payout's, a statement's). The declaring app is the caller's top-level package. Raises
    ``ValueError`` when another app declared ``value``."""
    app = sys._getframe(1).f_globals.get("__name__", "?").split(".")[0]
    if not value or len(value) > 32 or value != value.strip():
        raise ValueError(f"event type {value!r}: 1-32 characters")
    existing = _TYPES.get(value)
    if existing is not None:
        if existing.app != app:
            raise ValueError(f"event type {value!r} is declared twice ({existing.app} and {app})")
        return existing
    _TYPES[value] = EventType(value, label, app=app, private=private, owner_key=owner_key)
    return _TYPES[value]


def lookup(value: str) -> EventType | None:
    return _TYPES.get(str(value))


def registered() -> list[EventType]:
    """Every declared type, in declaration order (fleet's first, then each app as it is loaded)."""
    return list(_TYPES.values())


def choices() -> list[tuple[str, str]]:
    """``[(value, label)]`` of every declared type, sorted by value: the field's and the filter's
    choices (a callable, so Django reads it when asked, after every app declared its types)."""
    return sorted((str(t), t.label) for t in _TYPES.values())


def owner_keyed_types() -> dict[str, str]:
    """``{type value: owner_key}`` of the types whose node-less events their owner reads."""
    return {str(t): t.owner_key for t in _TYPES.values() if t.owner_key}


def private_types() -> frozenset[str]:
    """The values of the types only a node's owner and operators may read."""
    return frozenset(str(t) for t in _TYPES.values() if t.private)


# --- fleet's own words: a node's enrollment, lifecycle, liveness, health, credentials, policy.

ENROLLED = declare("enrolled", "enrolled")
TAKEN_OVER = declare("taken_over", "agent took the node over (bootstrap token naming it)")
LIFECYCLE = declare("lifecycle", "lifecycle transition")
ADMISSION_CHECK = declare("admission_check", "admission check")
BENCHMARK = declare("benchmark", "benchmark")
LIVENESS = declare("liveness", "liveness change")
READINESS = declare("readiness", "readiness change")
CONDITION = declare("condition", "condition change")
HEALTH = declare("health", "health change")
RESTART = declare("restart", "agent restart (new incarnation)")
CLOCK_SKEW = declare("clock_skew", "clock skew")
CREDENTIAL = declare("credential", "credential issued, rotated or revoked")
POLICY = declare("policy", "policy or metadata change")
GUARD = declare("guard", "mass-silence guard engaged or released")
CLOCK_JUMP = declare("clock_jump", "control-plane clock jump")
SECURITY = declare("security", "security event")
DEVICE = declare("device", "device inventory, health, taint or verification")
REVERIFICATION = declare("reverification", "scheduled re-verification started, passed or failed (deverified)")
