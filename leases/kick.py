"""The queue kick: ask a worker to place pending lease requests soon after something that may let
one fit (a lease ended, a node turned schedulable, work was requeued).

Below every module that kicks (leases.lifecycle, leases.requeue, leases.signals): it sends the
placement task by name, so it imports none of them (issue 28, step 4).
"""

from __future__ import annotations

from django.core.cache import cache

from nodepool import failsafe
from nodepool.celery import app as celery_app

from .choices import LeaseRequestState
from .models import LeaseRequest

KICK_WINDOW = 1  # seconds


def kick_queue() -> None:
    """Ask a worker to place pending requests: at once, at most once a ``KICK_WINDOW``; a kick
    inside the window is not dropped but deferred to its end (one trailing kick), so the last
    trigger of a burst (several nodes turning schedulable in the same second) is always followed
    by a placement that sees it."""
    # The cache first: node saves and lease ends are frequent, pending requests rare.
    if cache.add("leases:queue-kick", 1, timeout=KICK_WINDOW):
        options = {}
    elif cache.add("leases:queue-kick-trailing", 1, timeout=KICK_WINDOW):
        options = {"countdown": KICK_WINDOW}
    else:
        return  # a trailing kick is already due after this trigger
    if not LeaseRequest.objects.filter(state=LeaseRequestState.PENDING).exists():
        return
    # One bounded attempt, failing open (nodepool.failsafe): the beat entry places what it misses.
    # By name: leases.tasks runs the sweeps, which use this module (no import cycle).
    failsafe.publish(celery_app.signature("leases.place_pending_requests"), **options)
