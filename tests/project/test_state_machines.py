"""State machines on django-fsm-2 (issue 28, step 6): the generated graphs in docs/ agree with
the code; every FSM field is protected and its model refreshes safely under threads; the
set-based helper ``nodepool.fsm.move`` reads its WHERE and its new state from the declaration."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django_fsm import FSMFieldMixin

from fleet.choices import Lifecycle
from fleet.models import Node, Reverification
from nodepool import fsm
from nodepool.fsm import SerializedFSMRefresh
from nodepool.management.commands.state_machines import fsm_models
from tests.factories import NodeFactory


def test_docs_state_machines_page_is_generated_from_the_code():
    call_command("state_machines", "--check")


def test_every_fsm_field_is_protected_and_its_model_refreshes_serialized():
    for model in fsm_models():
        for field in model._meta.get_fields():
            if isinstance(field, FSMFieldMixin):
                assert field.protected, f"{model._meta.label}.{field.name} is not protected=True"
        assert issubclass(model, SerializedFSMRefresh), f"{model._meta.label} lacks SerializedFSMRefresh"


def test_sources_expand_the_declaration_and_its_wildcards():
    assert fsm.sources(Node, "admit") == (Lifecycle.ADMITTING,)
    assert set(fsm.sources(Node, "retire")) == set(Lifecycle.values) - {Lifecycle.RETIRED}
    assert fsm.target(Node, "retire") == Lifecycle.RETIRED
    assert fsm.state_field(Node, "retire") == "lifecycle"
    assert fsm.sources(Reverification, "cancel") == ("scheduled", "running")


def test_a_transition_name_that_is_not_declared_is_an_error():
    with pytest.raises(AttributeError):
        fsm.sources(Node, "save")


@pytest.mark.django_db
def test_move_only_moves_rows_in_a_declared_source_state():
    ready = NodeFactory(lifecycle=Lifecycle.READY)
    retired = NodeFactory(lifecycle=Lifecycle.RETIRED)
    assert fsm.move(Node.objects.filter(pk__in=[ready.pk, retired.pk]), "drain") == 1
    assert Node.objects.get(pk=ready.pk).lifecycle == Lifecycle.DRAINING
    assert Node.objects.get(pk=retired.pk).lifecycle == Lifecycle.RETIRED
