"""Both liveness compare-and-swaps, watched by their events (issue 29, item 7).

A status report (fleet/heartbeats.py) and a renewal reviving a node (fleet/renewals.py) each read
the node's liveness, then write ``alive`` with one ``liveness`` event from what they read; their
UPDATE carries ``liveness = <what was read>`` in its WHERE. The race that guard exists for: the
sweep moves the node on (``stale → unreachable``) between the read and the write. With the guard
the write matches nothing, the message reads the node again and writes ``unreachable → alive``;
without it, it writes ``stale → alive`` over a node that was ``unreachable``: the event log then
says the node went from ``stale`` to ``unreachable`` and from ``stale`` to ``alive``.

The sweep is run at that exact point (inside the message's transaction, on its connection, so
the interleaving is the same on SQLite and PostgreSQL and happens on every run, not by luck).
Each test fails when its guard is removed (docs/heartbeats.md, issue 29's closing note).
"""

from __future__ import annotations

import pytest

from fleet import event_types as fleet_events
from fleet import heartbeats, renewals
from fleet.choices import Liveness
from fleet.liveness_sweep import sweep_liveness
from fleet.models import Node, NodeEvent
from tests.factories import PoolFactory, make_schedulable_node
from tests.fleet.test_renewals import renew
from tests.heartbeat_support import T0, node_api, post_beat, seconds, send

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.race,
    pytest.mark.usefixtures("no_flood_guard", "clock_at_t0"),
]


def liveness_events(node) -> list[tuple[str, str]]:
    rows = NodeEvent.objects.filter(node=node, type=fleet_events.LIVENESS).order_by("created_at", "id")
    return [(e.from_state, e.to_state) for e in rows if not (e.data or {}).get("loss_withheld")]


def assert_a_chain(events: list[tuple[str, str]]) -> None:
    """Each liveness event starts where the one before it ended."""
    for (_, before), (after, _) in zip(events, events[1:], strict=False):
        assert after == before, f"the event log breaks: {events}"


@pytest.fixture
def stale_node(time_machine):
    """A node that renewed at T0 and went stale at T0 + 25 s; the clock then stands at T0 + 45 s,
    where the next sweep makes it unreachable (grace 40 s)."""
    node, secret = make_schedulable_node(PoolFactory())
    send(node, 1)
    time_machine.move_to(T0 + seconds(25), tick=False)
    sweep_liveness()
    assert Node.objects.get(pk=node.pk).liveness == Liveness.STALE
    time_machine.move_to(T0 + seconds(45), tick=False)
    return node, secret


def sweep_first(monkeypatch, module, name: str, *, when=lambda *a, **kw: True):
    """Make the sweep run once just before ``module.name`` (the message's guarded write)."""
    real = getattr(module, name)
    swept = []

    def wrapped(*args, **kwargs):
        if not swept and when(*args, **kwargs):
            swept.append(sweep_liveness())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return swept


def test_a_status_report_racing_the_sweep_revives_from_what_the_sweep_wrote(monkeypatch, stale_node):
    node, secret = stale_node
    swept = sweep_first(monkeypatch, heartbeats, "_conditional_update")

    response = post_beat(node_api(secret), node, sequence=2)

    assert response.status_code == 200 and response.json()["code"] == "applied"
    assert swept and swept[0]["moved"] == {"stale->unreachable": 1}
    events = liveness_events(node)
    assert_a_chain(events)
    assert events[-2:] == [(Liveness.STALE, Liveness.UNREACHABLE), (Liveness.UNREACHABLE, Liveness.ALIVE)]
    assert Node.objects.get(pk=node.pk).liveness == Liveness.ALIVE


def test_a_renewal_reviving_a_node_racing_the_sweep_revives_from_what_the_sweep_wrote(monkeypatch, stale_node):
    node, secret = stale_node
    swept = sweep_first(
        monkeypatch, renewals, "_try_statement", when=lambda **kw: kw["liveness_read"] != Liveness.ALIVE
    )

    response = renew(node, secret, sequence=2)

    assert response.status_code == 200 and response.json()["code"] == "applied", response.content
    assert swept and swept[0]["moved"] == {"stale->unreachable": 1}
    events = liveness_events(node)
    assert_a_chain(events)
    assert events[-2:] == [(Liveness.STALE, Liveness.UNREACHABLE), (Liveness.UNREACHABLE, Liveness.ALIVE)]
    assert Node.objects.get(pk=node.pk).liveness == Liveness.ALIVE
