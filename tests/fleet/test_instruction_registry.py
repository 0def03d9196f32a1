"""Heartbeat instructions: the bits are a wire contract, and the status-report handlers that give
the instructions run in an explicit order (fleet.instructions), not in INSTALLED_APPS order."""

from __future__ import annotations

import pytest

from fleet import instructions
from fleet.instructions import Instruction


def test_the_instruction_bits_keep_their_numbers():
    """Agents in the field read these numbers (docs/api-contract.md, the renewal's ``flags``)."""
    assert {member.name: member.value for member in Instruction} == {
        "LEASES": 1,
        "STOP": 2,
        "CHECKPOINT": 4,
        "BENCHMARK": 8,
        "ROTATE_CREDENTIAL": 16,
        "STATUS_REPORT": 32,
        "LIFECYCLE": 64,
        "HOLD": 128,
        "UPGRADE": 256,
        "PREEMPTION": 512,
        "SECRET": 1024,
        "REPAIR": 2048,
    }


def test_handlers_run_in_their_declared_order_whatever_the_registration_order(monkeypatch):
    monkeypatch.setattr(instructions, "_HANDLERS", {})
    calls = []

    def handler(name, answer):
        def run(**report):
            calls.append((name, report["node"]))
            return answer

        return run

    instructions.register_status_report_handler("c.third", handler("c", {"stop": ["3"], "upgrade": "c"}), order=30)
    instructions.register_status_report_handler("a.first", handler("a", {"stop": ["1"]}), order=10)
    instructions.register_status_report_handler("b.second", handler("b", {"stop": ["2"], "upgrade": "b"}), order=20)
    merged = instructions.status_report_instructions(sender=None, node="n")
    assert [name for name, _ in calls] == ["a", "b", "c"]
    # Lists concatenate in handler order; any other value: the first handler to give it wins.
    assert merged == {"stop": ["1", "2", "3"], "upgrade": "b"}


def test_two_handlers_never_share_an_order(monkeypatch):
    monkeypatch.setattr(instructions, "_HANDLERS", {})
    instructions.register_status_report_handler("a.one", lambda **report: None, order=10)
    instructions.register_status_report_handler("a.one", lambda **report: {}, order=10)  # ready() again
    with pytest.raises(ValueError, match="taken by a.one"):
        instructions.register_status_report_handler("b.other", lambda **report: None, order=10)


def test_the_apps_register_their_handlers_at_their_documented_orders():
    assert [(h.name, h.order) for h in instructions.status_report_handlers()] == [
        ("leases.reconcile_status_report", 100),
        ("leases.status_report_kicks_queue", 110),
        ("maintenance.rules", 200),
        ("operations.upgrade_instruction", 300),
        ("operations.repair_instruction", 310),
        ("marketplace.availability", 400),
    ]
