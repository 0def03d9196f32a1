"""Races on pool operations (run on PostgreSQL in CI, where the row locks are what is tested):
two operators acting on one upgrade version, two ticks of one upgrade, two notices for one node."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.events import Actor
from operations import preemption, rollout, upgrades
from operations.choices import UpgradeNodeState, UpgradeState
from operations.models import PoolOperations, Preemption, Upgrade, UpgradeNode
from tests.operations_support import ready_pool
from tests.races import Hold, race

pytestmark = [pytest.mark.race, pytest.mark.django_db(transaction=True)]
TARGET = {"version": "2.0.0"}
ACTOR = Actor.system("test:operator")


@pytest.fixture(autouse=True)
def _no_tick_chain(monkeypatch):
    """The racers are the only ticks: no (eager) tick chain starts with the upgrade."""
    monkeypatch.setattr("operations.upgrades.start_ticking", lambda upgrade: None)


def started_upgrade(pool, **fields) -> Upgrade:
    upgrade = upgrades.upgrade_create(data={"pool": pool.name, "target": TARGET, "canary_nodes": 0, **fields},
                                      actor=ACTOR)  # fmt: skip
    return upgrades.upgrade_start(upgrade_id=upgrade.pk, expected_version=upgrade.version, actor=ACTOR)


def test_two_operators_pausing_the_same_version_one_wins_the_other_gets_412():
    pool, _ = ready_pool("general", 3)
    upgrade = started_upgrade(pool)

    def pause(i):
        try:
            upgrades.upgrade_pause(upgrade_id=upgrade.pk, expected_version=upgrade.version, actor=ACTOR)
        except upgrades.Problem as exc:
            return exc.status_code
        return 200

    with Hold("operations.upgrades.check_version", parties=2) as hold:
        outcome = race(pause, 2)
    assert not outcome.errors
    assert sorted(outcome.results) == [200, 412]
    assert hold.max_inside == 1
    fresh = Upgrade.objects.get(pk=upgrade.pk)
    assert (fresh.state, fresh.version) == (UpgradeState.PAUSED, upgrade.version + 1)


def test_two_ticks_at_once_never_take_more_nodes_out_than_allowed():
    pool, _ = ready_pool("general", 4)
    upgrade = started_upgrade(pool, max_unavailable_nodes="1")
    assert not UpgradeNode.objects.filter(upgrade=upgrade).exclude(state=UpgradeNodeState.WAITING).exists()

    with Hold("operations.rollout._rolling", parties=2, after=False) as hold:
        outcome = race(lambda i: rollout.advance(upgrade_id=upgrade.pk), 2)
    assert not outcome.errors
    assert hold.max_inside == 1
    started = UpgradeNode.objects.filter(upgrade=upgrade).exclude(state=UpgradeNodeState.WAITING)
    assert started.count() == 1


def test_two_notices_for_one_node_make_one_preemption():
    pool, nodes = ready_pool("spot", 1)
    PoolOperations.objects.create(pool=pool, spot=True)
    node = nodes[0][0]
    deadline = timezone.now() + timedelta(seconds=60)

    def notice(i):
        record, created = preemption.preemption_notice(node_id=node.pk, deadline=deadline, source="agent", actor=ACTOR)
        return created

    outcome = race(notice, 2)
    assert not outcome.errors
    assert sorted(outcome.results) == [False, True]
    assert Preemption.objects.filter(node=node).count() == 1
