"""Threads refreshing protected-FSM rows at once (nodepool/fsm.py): django-fsm-2 lifts the field's
shared ``protected`` flag during a refresh, so without serialization one thread's refresh fails with
"Direct lifecycle modification is not allowed" when another re-protects the field mid-assignment.
Seen in the bulk-drain race and the twenty-node roll end to end (a deferred node field loaded
during a status report)."""

from __future__ import annotations

import pytest

from fleet.models import Node
from operations.models import Upgrade
from tests.factories import NodeFactory
from tests.races import race


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_threads_refreshing_nodes_and_loading_deferred_fields_never_trip_the_protected_lifecycle():
    node = NodeFactory()

    def refresh_many(_):
        for _ in range(150):
            copy = Node.objects.only("id", "lifecycle", "hostname").get(pk=node.pk)
            copy.refresh_from_db()  # the whole row, lifecycle included
            assert copy.boot_id == node.boot_id  # boot_id was deferred: loaded by a refresh too
        return "ok"

    outcome = race(refresh_many, 4)
    assert not outcome.errors, outcome.errors
    assert outcome.results == ["ok"] * 4


def test_every_model_with_a_protected_fsm_field_serializes_its_refresh():
    from django.apps import apps
    from django_fsm import FSMFieldMixin

    from nodepool.fsm import SerializedFSMRefresh

    protected = [
        model
        for model in apps.get_models()
        if any(isinstance(f, FSMFieldMixin) and f.protected for f in model._meta.concrete_fields)
    ]
    assert {Node, Upgrade} <= set(protected)
    assert [m.__name__ for m in protected if not issubclass(m, SerializedFSMRefresh)] == []
