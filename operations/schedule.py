"""Celery beat entries of pool operations (merged by nodepool.celery). Each expires before its next run."""

from . import conf

_UPGRADES = float(conf.get("UPGRADE_SWEEP_INTERVAL"))
_AUTOSCALE = float(conf.get("AUTOSCALE_INTERVAL"))
_REPLACEMENTS = float(conf.get("REPLACEMENT_SWEEP_INTERVAL"))
_REPAIR = float(conf.get("REPAIR_INTERVAL"))

BEAT_SCHEDULE = {
    # Safety net of the upgrade tick chains (a lost message, a worker killed mid-chain).
    "operations-sweep-upgrades": {
        "task": "operations.sweep_upgrades",
        "schedule": _UPGRADES,
        "options": {"expires": _UPGRADES * 0.9},
    },
    # Scale up for pending demand, scale down idle nodes, follow machines the provider started.
    "operations-autoscale": {
        "task": "operations.autoscale",
        "schedule": _AUTOSCALE,
        "options": {"expires": _AUTOSCALE * 0.9},
    },
    "operations-sweep-preemptions": {
        "task": "operations.sweep_preemptions",
        "schedule": 5.0,
        "options": {"expires": 4.5},
    },
    # Drift and expiry: replace drifted and expired nodes under the pool budgets.
    "operations-sweep-replacements": {
        "task": "operations.sweep_replacements",
        "schedule": _REPLACEMENTS,
        "options": {"expires": _REPLACEMENTS * 0.9},
    },
    # Repair rules: conditions held too long → reboot, replace or quarantine (operations.repair).
    "operations-sweep-repairs": {
        "task": "operations.sweep_repairs",
        "schedule": _REPAIR,
        "options": {"expires": _REPAIR * 0.9},
    },
}
