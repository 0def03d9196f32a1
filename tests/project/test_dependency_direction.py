"""Dependencies point one way (docs/foundation.md): nodepool plumbing <- fleet <- leases <- maintenance <- wiring.

The contracts live in pyproject.toml ([tool.importlinter]); import-linter's grimp graph includes
imports made inside functions, so "a lower app never imports a higher one, not even inside a
function" is what is checked.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_every_import_contract_is_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_the_layers_cover_every_module_of_the_nodepool_package():
    """A new plumbing or wiring module must be placed in a layer, or it would escape the contract."""
    layers = next(c for c in contracts() if c["type"] == "layers")["layers"]
    placed = {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}
    modules = {
        f"nodepool.{path.stem if path.is_file() else path.name}"
        for path in (ROOT / "nodepool").iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()
    }
    assert modules <= placed, f"not in any layer: {sorted(modules - placed)}"
    assert {"fleet", "leases", "maintenance", "operations"} <= placed


def test_fleet_declares_the_hooks_the_higher_apps_connect():
    from fleet import signals
    from fleet.instructions import status_report_handlers

    def uids(signal):  # Django keeps ((dispatch_uid, sender key), receiver, is_async) per receiver
        return [entry[0][0] for entry in signal.receivers]

    # Leases reconciles before maintenance's rules look at the node (explicit orders, not the order
    # apps are installed); operations answers a parked node's report with its upgrade instruction,
    # then a node under repair with its reboot instruction (issue 34 item 5).
    assert [handler.name for handler in status_report_handlers()] == [
        "leases.reconcile_status_report",
        "leases.status_report_kicks_queue",
        "maintenance.rules",
        "operations.upgrade_instruction",
        "operations.repair_instruction",
        "marketplace.availability",
    ]
    assert uids(signals.nodes_lost) == ["leases.lose_leases"]
    assert uids(signals.node_revived) == ["leases.revived_node_kicks"]


APPS = ("fleet", "leases", "maintenance", "operations", "marketplace")


def test_each_app_has_inner_layers_that_place_every_module():
    """Inside each app (issue 28, step 4): wiring (api, admin, beat schedule, collectors, tasks where
    no cycle holds them to the domain) <- domain modules <- models <- the app's words (choices, conf,
    errors, event types). A new module must be placed in one of its app's layers."""
    for app in APPS:
        [contract] = [c for c in contracts() if c["name"].startswith(f"{app} inside:")]
        assert contract["type"] == "layers"
        placed = {name.strip() for layer in contract["layers"] for name in layer.replace("|", ":").split(":")}
        modules = {
            f"{app}.{path.stem if path.is_file() else path.name}"
            for path in (ROOT / app).iterdir()
            if (path.suffix == ".py" and path.stem != "__init__")
            or ((path / "__init__.py").exists() and path.name != "migrations")
        }
        assert modules <= placed, f"{app}: not in any layer: {sorted(modules - placed)}"
        assert contract["layers"][-1].startswith(f"{app}.choices"), "the app's words are the bottom layer"
