"""The pending-instructions marker: what is waiting for a node, as a bit set on its row.

A renewal is one statement on the node's own row (fleet.renewals); it cannot look into the
tables of ``leases`` or ``maintenance`` (nor may ``fleet`` import them). So whoever leaves
something for a node raises a bit of ``Node.instructions`` with :func:`post_instructions`, and
the renewal answers the whole bit set as its ``flags``. Any flag means "send a status report":
its response carries the instructions themselves (assigned leases, stop and checkpoint orders,
the benchmark, the desired lifecycle, …), and an applied status report clears the marker in the
same conditional UPDATE that applies it, before the instructions are read, so an instruction
posted meanwhile raises the bit again rather than being lost.

Bits (documented in docs/api-contract.md; stable once published, new kinds take new bits):

====  ===================  ==========================================================
bit   name                 raised by
====  ===================  ==========================================================
1     LEASES               leases: a lease granted to the node
2     STOP                 leases: a lease on the node ended (released, revoked, lost…)
4     CHECKPOINT           leases/maintenance: a checkpoint asked of a lease
8     BENCHMARK            fleet.admission: a benchmark requested
16    ROTATE_CREDENTIAL    the renewal itself (not stored): under 25 % of the credential left
32    STATUS_REPORT        fleet: a status report wanted (overdue, new incarnation)
64    LIFECYCLE            maintenance/fleet: the lifecycle changed (drain, cordon, quarantine…)
128   HOLD                 reserved: cordon holds
256   UPGRADE              reserved: upgrade instructions
512   PREEMPTION           reserved: preemption notices
1024  SECRET               leases: a lease was renewed, so its per-lease secret changed
2048  REPAIR               operations.repair: a repair reboot waits for the node
====  ===================  ==========================================================

The instructions themselves (what a status report's answer carries beyond fleet's own) come from
the apps above through :func:`register_status_report_handler`, an explicit, ordered registry:
each handler names its place (``order``), so the order never depends on ``INSTALLED_APPS``.

=====  ====================================  ==================================================
order  handler                               what it does, what it returns
=====  ====================================  ==================================================
100    leases.reconcile_status_report        reconciles the reported leases: ``stop``,
                                             ``checkpoint``, ``assigned``
110    leases.status_report_kicks_queue      a report may free capacity: kicks the lease queue
200    maintenance.rules                     automatic quarantine, after leases reconciled
300    operations.upgrade_instruction        a parked node's ``upgrade`` instruction
310    operations.repair_instruction         a drained node's ``repair`` (reboot) instruction
400    marketplace.availability              availability evidence (returns nothing)
=====  ====================================  ==================================================
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.db import transaction
from django.db.models import F

from .models import Node


# The bits are a wire contract (docs/api-contract.md, agents in the field read them): a bit keeps
# its number forever; a new kind takes a new bit (tests/fleet/test_instruction_registry.py).
class Instruction(enum.IntFlag):
    LEASES = 1
    STOP = 2
    CHECKPOINT = 4
    BENCHMARK = 8
    ROTATE_CREDENTIAL = 16
    STATUS_REPORT = 32
    LIFECYCLE = 64
    HOLD = 128
    UPGRADE = 256
    PREEMPTION = 512
    SECRET = 1024
    REPAIR = 2048


def post_instructions(node_ids: Iterable, flags: int, *, on_commit: bool = True) -> None:
    """Raise ``flags`` on the pending-instructions marker of every node in ``node_ids``.

    Args:
        node_ids: node primary keys (UUIDs or their strings); empty does nothing.
        flags: an :class:`Instruction` bit set.
        on_commit: when called inside a transaction, raise the bits once it commits (the
            default): the node must not be told before what waits for it is visible, and the
            one-row UPDATE then holds no lock of the caller's transaction.

    One UPDATE (``instructions = instructions | flags``): concurrent posters never lose a bit.
    """
    ids = list(node_ids)
    if not ids or not flags:
        return

    def raise_bits():
        Node.objects.filter(pk__in=ids).update(instructions=F("instructions").bitor(int(flags)))

    if on_commit:
        transaction.on_commit(raise_bits)
    else:
        raise_bits()


@dataclass(frozen=True)
class StatusReportHandler:
    """One entry of the ordered registry: ``name`` (``<app>.<what>``), ``order`` (lower runs
    first) and ``handler(sender, node, incarnation, leases, usage, agent_version, restarted,
    actor)`` returning a dict of instructions or None."""

    name: str
    order: int
    handler: Callable[..., dict | None]


_HANDLERS: dict[str, StatusReportHandler] = {}


def register_status_report_handler(name: str, handler: Callable[..., dict | None], *, order: int) -> None:
    """Run ``handler`` after every applied status report, at ``order`` (see the table above).

    Called from the registering app's ``AppConfig.ready()``; registering ``name`` again replaces
    it (``ready()`` may run twice in tests). Raises ``ValueError`` when another handler holds
    ``order``: two handlers never tie, so the order is written, not inferred."""
    taken = next((h for h in _HANDLERS.values() if h.order == order and h.name != name), None)
    if taken is not None:
        raise ValueError(f"status report handler order {order} is taken by {taken.name}")
    _HANDLERS[name] = StatusReportHandler(name, order, handler)


def status_report_handlers() -> list[StatusReportHandler]:
    """The registered handlers, in the order they run."""
    return sorted(_HANDLERS.values(), key=lambda h: h.order)


def status_report_instructions(**report) -> dict:
    """Run every handler in order with ``report`` (the keyword arguments above, ``sender`` included)
    and merge what they return: lists are concatenated in handler order, and for any other value
    the first handler to give a key wins. Exceptions propagate (the heartbeat's transaction)."""
    merged: dict = {}
    for entry in status_report_handlers():
        for key, value in (entry.handler(**report) or {}).items():
            if isinstance(value, list):
                merged[key] = [*(merged.get(key) or []), *value]
            else:
                merged.setdefault(key, value)
    return merged
