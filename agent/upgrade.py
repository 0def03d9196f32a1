"""The agent's side of a rolling upgrade: run the locally configured command for an action.

The control plane's ``upgrade`` instruction names a target ``version``, an ``artifact`` (``ref``
and ``sha256``) and an ``action``. The agent runs only commands its operator configured for that
action (``--upgrade-action NAME=COMMAND``): the control plane never sends a command line. The
command gets the instruction in its environment (``NODEPOOL_UPGRADE_VERSION``,
``NODEPOOL_UPGRADE_ARTIFACT``, ``NODEPOOL_UPGRADE_SHA256``, ``NODEPOOL_UPGRADE_ACTION``) and is
expected to install it (checking the SHA-256 itself) and, typically, update the version file the
agent reads (``--version-file``). On success the agent restarts itself, so it comes back with a
new incarnation and reports the new version; admission then verifies the target.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import __version__

log = logging.getLogger(__name__)
agent_log = logging.getLogger("agent")  # the Upgrades mixin logs as the agent's loop did
UPGRADE_TIMEOUT = 900.0


def current_version(version_file: Path | None) -> str:
    """The version this agent reports: the version file's first line if configured and readable,
    else the package's own version."""
    if version_file is not None:
        try:
            text = version_file.read_text().strip().splitlines()
        except OSError:
            text = []
        if text and text[0].strip():
            return text[0].strip()[:64]
    return __version__


@dataclass
class UpgradeResult:
    ran: bool
    ok: bool
    detail: str


def run_upgrade(instruction: dict, *, actions: dict[str, list[str]], version: str,
                timeout: float = UPGRADE_TIMEOUT) -> UpgradeResult:  # fmt: skip
    """Carry out ``instruction`` with the command configured for its action.

    Returns ``ran=False`` when there is nothing to do (already at the version) or nothing allowed
    (no command for that action); ``ok`` tells whether the command exited 0.
    """
    target = str(instruction.get("version") or "")
    action = str(instruction.get("action") or "agent")
    if not target or target == version:
        return UpgradeResult(False, True, f"already at {version}")
    argv = actions.get(action)
    if not argv:
        return UpgradeResult(False, False, f"no upgrade command configured for action {action!r}")
    artifact = instruction.get("artifact") or {}
    env = {
        **os.environ,
        "NODEPOOL_UPGRADE_VERSION": target,
        "NODEPOOL_UPGRADE_ARTIFACT": str(artifact.get("ref") or ""),
        "NODEPOOL_UPGRADE_SHA256": str(artifact.get("sha256") or ""),
        "NODEPOOL_UPGRADE_ACTION": action,
    }
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return UpgradeResult(True, False, f"upgrade command failed: {exc}")
    if done.returncode != 0:
        return UpgradeResult(True, False, f"upgrade command exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return UpgradeResult(True, True, f"upgraded to {target}")


class Upgrades:
    """The ``upgrade`` instruction (part of :class:`agent.runner.Agent`; split from agent/runner.py)."""

    def upgrade(self, instruction: dict) -> None:
        """Run the configured command for the instruction's action; on success, restart.

        A refused or failed upgrade is not retried for the same (upgrade, version): the control
        plane's node timeout fails the node, and the operator sees why in the agent's agent_log.
        """
        key = (str(instruction.get("upgrade_id", "")), str(instruction.get("version", "")))
        if key in self.upgrades_refused or self.restart_requested:
            return
        result = run_upgrade(instruction, actions=self.config.upgrade_actions, version=self.version)
        if result.ok and result.ran:
            agent_log.info("%s; restarting", result.detail)
            self.restart_requested = True
        elif not result.ok:
            agent_log.error("upgrade to %s not done: %s", key[1], result.detail)
            self.upgrades_refused.add(key)
