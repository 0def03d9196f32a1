"""The agent's side of an automated repair: run the operator-configured reboot command.

The control plane's ``repair`` instruction is ``{"repair_id", "action": "reboot"}`` (a pool's repair
rule fired and the node was drained: docs/pool-operations.md, "Repair"). The agent runs only the
command its operator configured for the action (``--repair-reboot-command`` or the environment
variable ``NODEPOOL_REPAIR_REBOOT_COMMAND``, e.g. ``"systemctl reboot"``): the control plane never
sends a command line, and any other member of the instruction is ignored. The command gets
``NODEPOOL_REPAIR_ID`` and ``NODEPOOL_REPAIR_ACTION`` in its environment.

Each repair is carried out at most once (a repeated instruction for the same ``repair_id`` does
nothing). A command that exits 0 without taking the machine down (a soft repair, a test's fake
command) is followed by the agent restarting itself, so the control plane sees a new incarnation:
that is the reboot it waits for. Without a configured command, or when it fails, the agent logs
why and does nothing else; the control plane fails the repair after ``REPAIR_REBOOT_TIMEOUT``.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
REBOOT = "reboot"
ENV_REBOOT_COMMAND = "NODEPOOL_REPAIR_REBOOT_COMMAND"
REPAIR_TIMEOUT = 300.0


def reboot_command_from(option: str | None, environ=os.environ) -> list[str]:
    """The configured reboot command as argv: the CLI option, else the environment variable, else
    none (``[]``: the agent then refuses reboot instructions)."""
    text = option if option is not None else environ.get(ENV_REBOOT_COMMAND, "")
    return shlex.split(text) if text and text.strip() else []


@dataclass
class RepairResult:
    ran: bool
    ok: bool
    detail: str


@dataclass
class Repairs:
    """What this agent may do for repairs (``commands``: action → argv) and what it already did."""

    commands: dict[str, list[str]] = field(default_factory=dict)
    timeout: float = REPAIR_TIMEOUT
    done: set = field(default_factory=set)

    def carry_out(self, instruction: dict) -> RepairResult:
        """Run the configured command for ``instruction["action"]``, once per ``repair_id``.

        Returns ``ran=False`` for a repeated or unconfigured instruction; ``ok`` tells whether the
        command exited 0 (the caller then restarts the agent)."""
        repair_id = str(instruction.get("repair_id") or "")
        action = str(instruction.get("action") or "")
        if not repair_id or repair_id in self.done:
            return RepairResult(False, True, f"repair {repair_id or '?'} already handled")
        self.done.add(repair_id)
        argv = self.commands.get(action)
        if not argv:
            return RepairResult(False, False, f"no repair command configured for action {action!r}")
        env = {**os.environ, "NODEPOOL_REPAIR_ID": repair_id, "NODEPOOL_REPAIR_ACTION": action}
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=self.timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return RepairResult(True, False, f"repair command failed: {exc}")
        if done.returncode != 0:
            return RepairResult(True, False, f"repair command exited {done.returncode}: {done.stderr.strip()[-500:]}")
        return RepairResult(True, True, f"repair {repair_id}: {action} command done")


def handle(repairs: Repairs, instruction: dict) -> bool:
    """The runner's hook: carry out ``instruction`` and log; True when the agent should restart."""
    result = repairs.carry_out(instruction)
    if result.ok and result.ran:
        log.warning("%s; restarting", result.detail)
        return True
    if not result.ok:
        log.error("repair not done: %s", result.detail)
    return False
