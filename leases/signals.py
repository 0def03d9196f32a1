"""Kick the request queue when a node may have become schedulable (saved as ready + alive)."""

from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver

from fleet.choices import Lifecycle, Liveness
from fleet.models import Node


@receiver(post_save, sender=Node, dispatch_uid="leases.node_saved_kicks_queue")
def node_saved(sender, instance: Node, **kwargs):
    # Cheap test first: only nodes that look schedulable can place anything. kick_queue itself
    # checks for pending requests and deduplicates kicks to one a second.
    if instance.lifecycle == Lifecycle.READY and instance.liveness == Liveness.ALIVE and instance.ready:
        from .services import kick_queue

        transaction.on_commit(kick_queue)
