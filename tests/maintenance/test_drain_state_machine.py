"""The drain's state machine (issue 28, step 6): ``Drain.state`` is a protected FSM field, and
each claim that moves it — complete, force at the deadline, cancel, abort — is built from the
declared transition, so the statement the database runs and the graph in docs/ cannot drift."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
import time_machine
from django.db import connection
from django.test.utils import CaptureQueriesContext

from maintenance import tasks
from maintenance.choices import DrainState
from maintenance.models import Drain
from nodepool import fsm
from tests.factories import make_schedulable_node
from tests.maintenance_support import act, make_lease

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)


@pytest.fixture
def clock():
    with time_machine.travel(T0, tick=False) as traveller:
        yield traveller


@pytest.fixture
def node(clock):
    return make_schedulable_node()[0]


DECLARED = {
    "complete": ((DrainState.ACTIVE,), DrainState.COMPLETED),
    "force": ((DrainState.ACTIVE,), DrainState.FORCED),
    "cancel": ((DrainState.ACTIVE,), DrainState.CANCELLED),
    "abort": ((DrainState.ACTIVE,), DrainState.ABORTED),
}


def test_the_declared_graph_every_drain_ends_from_active():
    assert {verb: (fsm.sources(Drain, verb), fsm.target(Drain, verb)) for verb in DECLARED} == DECLARED


def _state_moves(queries) -> list[tuple[set[str], str]]:
    """``(states in the WHERE, state SET)`` of every UPDATE of the drain table that sets its state."""
    moves = []
    for query in queries:
        sql = query["sql"].replace('"', "")
        if not sql.startswith("UPDATE maintenance_drain SET") or "state = " not in sql.split(" WHERE ")[0]:
            continue
        head, where = sql.split(" WHERE ", 1)
        target = re.search(r"\bstate = '(\w+)'", head).group(1)
        sources = re.search(r"maintenance_drain\.state IN \(([^)]*)\)", where).group(1)
        moves.append(({s.strip().strip("'") for s in sources.split(",")}, target))
    return moves


def _ran(verb, queries):
    sources, target = fsm.sources(Drain, verb), fsm.target(Drain, verb)
    assert _state_moves(queries) == [(set(sources), target)]


def test_the_completion_claim_is_the_declared_complete(operator_api, node):
    with CaptureQueriesContext(connection) as queries:
        act(operator_api, node, "drain", {"reason": "rack move", "deadline_in": 600})
    _ran("complete", queries)
    assert Drain.objects.get(node=node).state == DrainState.COMPLETED


def test_the_deadline_claim_is_the_declared_force(operator_api, node, clock):
    make_lease(node, "job-1", ttl=7200)
    act(operator_api, node, "drain", {"reason": "rack move", "deadline_in": 600})
    drain = Drain.objects.get(node=node)
    clock.shift(601)
    with CaptureQueriesContext(connection) as queries:
        tasks.enforce_drain_deadline(str(drain.pk))
    _ran("force", queries)
    drain.refresh_from_db()
    assert drain.state == DrainState.FORCED


def test_the_cancel_is_the_declared_cancel(operator_api, node):
    make_lease(node, "job-1")
    act(operator_api, node, "drain", {"reason": "rack move", "deadline_in": 600})
    drain = Drain.objects.get(node=node)
    with CaptureQueriesContext(connection) as queries:
        response = operator_api.post(f"/api/v1/drains/{drain.pk}/cancel", {"reason": "moved"}, HTTP_IF_MATCH='"1"')
    assert response.status_code == 200, response.json()
    _ran("cancel", queries)


def test_the_abort_is_the_declared_abort(operator_api, node):
    make_lease(node, "job-1")
    act(operator_api, node, "drain", {"reason": "rack move", "deadline_in": 600})
    with CaptureQueriesContext(connection) as queries:
        act(operator_api, node, "quarantine", {"reason": "incident"})
    _ran("abort", queries)
    assert Drain.objects.get(node=node).state == DrainState.ABORTED


def test_the_state_is_protected_and_a_loaded_drain_refreshes(operator_api, node):
    act(operator_api, node, "drain", {"reason": "rack move", "deadline_in": 600})
    drain = Drain.objects.get(node=node)
    with pytest.raises(AttributeError):
        drain.state = DrainState.ACTIVE
    drain.refresh_from_db()
    assert drain.state == DrainState.COMPLETED
