"""Celery tasks of pool operations: thin wrappers over the services.

The upgrade workflow is driven by a tick chain: ``operations.advance_upgrade`` runs one tick and
queues the next one ``UPGRADE_TICK`` seconds later while the workflow wants more. Each chain
carries the upgrade's ``tick_generation``; starting a new chain bumps it, so an older chain
stops at its next run (no two chains drive one upgrade for long). The beat entry
``operations.sweep_upgrades`` restarts the chain of an upgrade whose last tick is overdue (a
lost message, a worker killed mid-chain).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from fleet.events import Actor

from . import (
    autoscaler,
    conf,
    consolidation,
    launches,
    outofservice,
    preemption,
    repair,
    replacement_sweep,
    rollout,
    upgrades,
)
from .choices import PreemptionState
from .models import Preemption, Upgrade
from .rollout import TICKING_STATES

logger = logging.getLogger(__name__)


@shared_task(name="operations.advance_upgrade", bind=True, ignore_result=True)
def advance_upgrade(self, upgrade_id: str, generation: int) -> str:
    """One tick of an upgrade, then the next one (unless superseded, finished or eager)."""

    if not Upgrade.objects.filter(pk=upgrade_id, tick_generation=generation).exists():
        return "superseded"
    try:
        more = rollout.advance(upgrade_id=upgrade_id, actor=Actor.system(outofservice.UPGRADE, self.request.id or ""))
    except Exception:
        # A tick that fails (a database hiccup) is tried again at the next one; the sweep is the backstop.
        logger.exception("upgrade %s: tick failed", upgrade_id)
        more = True
    if more and not self.request.is_eager:
        advance_upgrade.apply_async(args=[upgrade_id, generation], countdown=float(conf.get("UPGRADE_TICK")))
    return "ticking" if more else "stopped"


@shared_task(name="operations.sweep_upgrades", ignore_result=True)
def sweep_upgrades() -> int:
    """Restart the tick chain of every ticking upgrade whose last tick is overdue. Returns how many."""

    overdue = timezone.now() - timedelta(seconds=5 * float(conf.get("UPGRADE_TICK")))
    restarted = 0
    for upgrade in Upgrade.objects.filter(state__in=TICKING_STATES).filter(
        Q(last_tick_at__isnull=True) | Q(last_tick_at__lt=overdue)
    ):
        with transaction.atomic():
            upgrades.start_ticking(upgrade)
        restarted += 1
    return restarted


@shared_task(name="operations.autoscale", bind=True, ignore_result=True)
def autoscale(self) -> dict:
    """Beat: one autoscaling pass over every pool with a provider (see :mod:`operations.autoscaler`),
    then one consolidation step for each pool that consolidates (:mod:`operations.consolidation`)."""

    result = autoscaler.autoscale_all(actor=Actor.system(outofservice.AUTOSCALER, self.request.id or ""))
    consolidated = consolidation.consolidate_all(actor=Actor.system(outofservice.CONSOLIDATION, self.request.id or ""))
    return {"autoscaled": result, "consolidated": consolidated}


@shared_task(name="operations.sweep_preemptions", bind=True, ignore_result=True)
def sweep_preemptions(self) -> int:
    """Beat: finish preemptions whose node is drained (retire it through the provider)."""

    return preemption.sweep(actor=Actor.system(outofservice.PREEMPTION, self.request.id or ""))


@shared_task(name="operations.follow_preemption", bind=True, ignore_result=True)
def follow_preemption(self, preemption_id: int) -> str:
    """Evaluate one preemption's drain every ``UPGRADE_TICK`` seconds until its node is drained."""

    try:
        preemption.follow(
            preemption_id=preemption_id, actor=Actor.system(outofservice.PREEMPTION, self.request.id or "")
        )
    except Exception:
        logger.exception("preemption %s: evaluation failed", preemption_id)
    still_open = Preemption.objects.filter(pk=preemption_id, state=PreemptionState.DRAINING).exists()
    if still_open and not self.request.is_eager:
        follow_preemption.apply_async(args=[preemption_id], countdown=float(conf.get("UPGRADE_TICK")))
    return "draining" if still_open else "drained"


@shared_task(name="operations.request_surge", bind=True, ignore_result=True)
def request_surge(self, pool_id: int, count: int, upgrade_id: str) -> int:
    """An upgrade's surge: ``count`` extra nodes from the pool's provider (once per upgrade)."""

    return launches.request_surge(
        pool_id=pool_id,
        count=count,
        upgrade_id=upgrade_id,
        actor=Actor.system(outofservice.AUTOSCALER, self.request.id or ""),
    )


@shared_task(name="operations.request_replacement", bind=True, ignore_result=True)
def request_replacement(self, pool_id: int, preemption_id: int, node_id: str) -> int:
    """A preempted node's replacement, asked at once (once per preemption)."""

    return launches.request_replacement(
        pool_id=pool_id,
        preemption_id=preemption_id,
        node_id=node_id,
        actor=Actor.system(outofservice.AUTOSCALER, self.request.id or ""),
    )


@shared_task(name="operations.sweep_replacements", bind=True, ignore_result=True)
def sweep_replacements(self) -> dict:
    """Beat: find drifted and expired nodes and move their replacements (operations.replacement)."""

    return replacement_sweep.sweep(actor=Actor.system("operations.sweep_replacements", self.request.id or ""))


@shared_task(name="operations.sweep_repairs", bind=True, ignore_result=True)
def sweep_repairs(self) -> dict:
    """Beat: one repair pass over every pool with repair rules (see :mod:`operations.repair`)."""

    return repair.sweep(actor=Actor.system(outofservice.REPAIR, self.request.id or ""))
