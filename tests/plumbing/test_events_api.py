"""GET /events (filters, cursor pagination, scoping) and GET /nodes/{id}/events (a node's timeline)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from urllib.parse import urlencode

import pytest
from django.utils import timezone

from fleet import event_types as fleet_events
from fleet.events import Actor, record_event
from fleet.models import NodeEvent
from leases import event_types as leases_events
from tests.factories import NodeFactory, PoolFactory

pytestmark = pytest.mark.django_db
SYSTEM = Actor.system("fleet.sweep_liveness")


def at(event: NodeEvent, when) -> NodeEvent:
    NodeEvent.objects.filter(pk=event.pk).update(created_at=when)
    return event


@pytest.fixture
def story(owner, other_owner):
    """Two pools; the owner's node with a short history, another owner's node, a pool-only event."""
    now = timezone.now()
    gpu, cpu = PoolFactory(name="gpu"), PoolFactory(name="cpu")
    mine = NodeFactory(pool=gpu, owner=owner, hostname="mine")
    theirs = NodeFactory(pool=cpu, owner=other_owner, hostname="theirs")
    lease_id = uuid.uuid4()
    events = {
        "enrolled": at(record_event(mine, fleet_events.ENROLLED, Actor.for_node(mine)), now - timedelta(hours=5)),
        "admitted": at(
            record_event(
                mine,
                fleet_events.LIFECYCLE,
                Actor.system("fleet.run_admission"),
                from_state="admitting",
                to_state="ready",
                reason="every admission check passed",
            ),
            now - timedelta(hours=4),
        ),  # fmt: skip
        "lease": at(
            record_event(
                mine,
                leases_events.LEASE,
                Actor.system("test"),
                to_state="granted",
                lease_id=lease_id,
                workload_id="train-7",
                data={"lease_id": str(lease_id)},
            ),
            now - timedelta(hours=3),
        ),  # fmt: skip
        "gap": at(
            record_event(mine, fleet_events.LIVENESS, SYSTEM, from_state="alive", to_state="stale"),
            now - timedelta(hours=2),
        ),
        "recovered": at(
            record_event(mine, fleet_events.LIVENESS, Actor.for_node(mine), from_state="stale", to_state="alive"),
            now - timedelta(hours=1),
        ),
        "theirs": at(record_event(theirs, fleet_events.ENROLLED, Actor.for_node(theirs)), now - timedelta(minutes=30)),
        "guard": at(
            record_event(None, fleet_events.GUARD, SYSTEM, pool=cpu, to_state="engaged"), now - timedelta(minutes=10)
        ),
    }
    return {"mine": mine, "theirs": theirs, "lease_id": lease_id, "events": events, "now": now}


def ids(response) -> list[int]:
    assert response.status_code == 200, response.json()
    return [e["id"] for e in response.json()["results"]]


def get(api, path="/api/v1/events", **params):
    return api.get(f"{path}?{urlencode(params, doseq=True)}" if params else path)


def test_operators_read_every_event_newest_first(operator_api, story):
    expected = sorted(story["events"].values(), key=lambda e: NodeEvent.objects.get(pk=e.pk).created_at, reverse=True)
    assert ids(get(operator_api)) == [e.pk for e in expected]


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"pool": "cpu"}, ["guard", "theirs"]),
        ({"type": ["liveness"]}, ["recovered", "gap"]),
        ({"type": ["liveness", "enrolled"]}, ["theirs", "recovered", "gap", "enrolled"]),
        ({"workload": "train-7"}, ["lease"]),
        ({"actor": "fleet.sweep_liveness"}, ["guard", "gap"]),
    ],
)
def test_events_filter_by_pool_type_workload_and_actor(operator_api, story, params, names):
    assert ids(get(operator_api, **params)) == [story["events"][n].pk for n in names]


def test_events_filter_by_node_lease_and_time_window(operator_api, story):
    now, events = story["now"], story["events"]
    assert ids(get(operator_api, node=str(story["theirs"].pk))) == [events["theirs"].pk]
    assert ids(get(operator_api, lease=str(story["lease_id"]))) == [events["lease"].pk]
    window = {"since": (now - timedelta(hours=3)).isoformat(), "until": (now - timedelta(hours=1)).isoformat()}
    assert ids(get(operator_api, **window)) == [events["gap"].pk, events["lease"].pk]  # until is exclusive


def test_cursor_pagination_walks_every_event_once_even_as_new_ones_arrive(operator_api, story):
    first = get(operator_api, page_size=3).json()
    assert len(first["results"]) == 3 and first["next"]
    record_event(story["mine"], fleet_events.HEALTH, SYSTEM, to_state="healthy")  # arrives mid-walk
    seen = [e["id"] for e in first["results"]]
    url = first["next"]
    while url:
        page = operator_api.get(url).json()
        seen += [e["id"] for e in page["results"]]
        url = page["next"]
    assert sorted(seen) == sorted(e.pk for e in story["events"].values())


def test_owners_see_only_their_own_nodes_events(owner_api, story):
    events = story["events"]
    assert set(ids(get(owner_api))) == {events[n].pk for n in ("enrolled", "admitted", "lease", "gap", "recovered")}
    assert ids(get(owner_api, node=str(story["theirs"].pk))) == []


def test_a_node_timeline_reads_from_enrollment_to_recovery(owner_api, story):
    response = get(owner_api, f"/api/v1/nodes/{story['mine'].pk}/events")
    body = response.json()["results"]
    assert [e["type"] for e in body] == ["enrolled", "lifecycle", "lease", "liveness", "liveness"]
    assert body[1]["summary"] == "lifecycle admitting → ready: every admission check passed"
    assert body[3]["summary"] == "liveness alive → stale"
    assert body[2]["lease_id"] == str(story["lease_id"]) and body[2]["pool"] == "gpu"


def test_a_timeline_of_someone_elses_node_is_a_404(owner_api, story):
    response = get(owner_api, f"/api/v1/nodes/{story['theirs'].pk}/events")
    assert response.status_code == 404
    assert response.json()["code"] == "node_not_found"


def test_anonymous_users_read_no_events(anon_api, story):
    assert get(anon_api).status_code == 401


@pytest.mark.parametrize(
    ("params", "code"),
    [
        ({"node": "not-a-uuid"}, None),
        ({"lease": "42"}, None),
        ({"type": "party"}, None),
        ({"since": "yesterday"}, None),
        ({"since": "2026-01-01T00:00:00"}, "timezone_required"),
        ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "invalid_filter"),
        ({"cursor": "bm9wZQ"}, "invalid_cursor"),
        ({"page_size": "lots"}, "invalid_page_size"),
    ],
)
def test_bad_event_filters_are_a_400_problem(operator_api, story, params, code):
    before = NodeEvent.objects.count()
    response = get(operator_api, **params)
    assert response.status_code == 400, response.json()
    assert response["Content-Type"].startswith("application/problem+json")
    if code:
        assert response.json()["code"] == code
    assert NodeEvent.objects.count() == before
