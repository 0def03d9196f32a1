"""The operations state machines on django-fsm-2 (issue 28, step 6): UpgradeNode, ProviderMachine
and Preemption declare their moves on the model; the set-based statements and the claims that move
their rows read the WHERE state IN (…) and the new state from that declaration, and agree with it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from django_fsm import TransitionNotAllowed

from nodepool import fsm
from operations import machines
from operations.choices import (
    LIVE_MACHINE_STATES,
    NODE_IN_PROGRESS,
    MachineState,
    PreemptionSource,
    PreemptionState,
    ProviderKind,
    UpgradeNodeState,
    UpgradePhase,
)
from operations.models import Preemption, ProviderMachine, Upgrade, UpgradeNode
from tests.factories import NodeFactory, PoolFactory


def test_the_statements_states_are_the_declarations():
    # The claims the services build (operations.machines._moved, operations.upgrades, preemption).
    assert fsm.sources(ProviderMachine, "claim_removal") == (*LIVE_MACHINE_STATES, MachineState.DRAINING)
    assert fsm.target(ProviderMachine, "claim_removal") == MachineState.DELETING
    assert fsm.sources(ProviderMachine, "drain") == (MachineState.READY,)
    assert fsm.sources(ProviderMachine, "fail") == (MachineState.REQUESTED, MachineState.DELETING)
    assert fsm.sources(UpgradeNode, "skip") == (UpgradeNodeState.WAITING,)
    assert fsm.sources(UpgradeNode, "abandon") == NODE_IN_PROGRESS
    assert fsm.target(UpgradeNode, "abandon") == UpgradeNodeState.SKIPPED
    assert fsm.sources(UpgradeNode, "retry") == (UpgradeNodeState.FAILED,)
    assert fsm.sources(Preemption, "close") == (PreemptionState.DRAINING,)
    assert fsm.target(Preemption, "close") == PreemptionState.DRAINED


def test_the_fields_are_protected():
    machine = ProviderMachine(name="m", provider=ProviderKind.SIMULATED, requested_at=timezone.now())
    machine.enroll()
    with pytest.raises(AttributeError):
        machine.state = MachineState.READY
    with pytest.raises(TransitionNotAllowed):
        machine.drain()  # enrolled, not ready


def _machine(pool, state, name):
    return ProviderMachine.objects.create(
        pool=pool, provider=ProviderKind.SIMULATED, name=name, state=state, requested_at=timezone.now()
    )


@pytest.mark.django_db
def test_a_machine_moves_only_along_the_declaration_and_the_instance_follows():
    pool = PoolFactory()
    ready = _machine(pool, MachineState.READY, "ready")
    requested = _machine(pool, MachineState.REQUESTED, "requested")
    # requested → draining is not declared: the compare-and-swap moves nothing.
    assert not machines._moved(requested, "drain")
    assert ProviderMachine.objects.get(pk=requested.pk).state == MachineState.REQUESTED
    assert machines._moved(ready, "drain")
    assert ready.state == MachineState.DRAINING
    assert ProviderMachine.objects.get(pk=ready.pk).state == MachineState.DRAINING
    # Read before another pass moved it: the stale compare-and-swap moves nothing.
    stale = ProviderMachine.objects.get(pk=requested.pk)
    assert machines._moved(requested, "claim_removal", removal_reason="gone")
    assert not machines._moved(stale, "enroll")
    row = ProviderMachine.objects.get(pk=requested.pk)
    assert (row.state, row.removal_reason) == (MachineState.DELETING, "gone")


@pytest.mark.django_db
def test_upgrade_node_set_moves_leave_rows_outside_the_declared_sources():
    pool = PoolFactory()
    upgrade = Upgrade.objects.create(pool=pool, target={"version": "2.0.0"})
    rows = {
        state: UpgradeNode.objects.create(
            upgrade=upgrade, node=NodeFactory(pool=pool), phase=UpgradePhase.ROLL, position=i, state=state
        )
        for i, state in enumerate(UpgradeNodeState.values)
    }
    assert fsm.move(UpgradeNode.objects.filter(upgrade=upgrade), "abandon", detail="x") == len(NODE_IN_PROGRESS)
    after = dict(UpgradeNode.objects.filter(upgrade=upgrade).values_list("pk", "state"))
    for state, row in rows.items():
        moved = state in NODE_IN_PROGRESS
        assert after[row.pk] == (UpgradeNodeState.SKIPPED if moved else state), state


@pytest.mark.django_db
def test_a_preemption_closes_once():
    node = NodeFactory()
    now = timezone.now()
    preemption = Preemption.objects.create(
        node=node,
        pool=node.pool,
        source=PreemptionSource.values[0],
        deadline=now + timedelta(minutes=2),
        received_at=now,
    )
    assert fsm.move(Preemption.objects.filter(pk=preemption.pk), "close", finished_at=now) == 1
    assert fsm.move(Preemption.objects.filter(pk=preemption.pk), "close", finished_at=now) == 0
    preemption.refresh_from_db()
    assert preemption.state == PreemptionState.DRAINED
