"""Event privacy on every read path: ``GET /events``, ``/events?type=…``, ``/nodes/{id}/events`` and
``recent_events`` of ``GET /nodes/{id}``.

* Appeal events carry the owner's statement and the operator's resolution (free text): they are
  for the node's owner and operators only (declared ``private=True`` in fleet.event_types).
* Drain events list the node's lease ids (``checkpoint_leases``, ``waiting_on[].lease_ids``): a
  client reads only its own there; operators and the node's owner read them all.
"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Group, User

from fleet.events import Actor, record_event
from fleet.models import NodeEvent
from maintenance import event_types as maintenance_events
from maintenance import services as maintenance
from marketplace import appeals
from marketplace import event_types as marketplace_events
from nodepool.api.permissions import CLIENTS
from tests.conftest import _api
from tests.factories import make_schedulable_node
from tests.maintenance_support import act, make_lease

pytestmark = pytest.mark.django_db
API = "/api/v1"
STATEMENT = "It was a disk error on rack 7, our contractor Bob fixed it."
RESOLUTION = "Upheld: the replacement disk reports the same hash mismatch."


def _reads(api, node, *, query="") -> dict[str, str]:
    """What ``api``'s user reads on each event surface about ``node``, as JSON text."""
    detail = api.get(f"{API}/nodes/{node.pk}")
    return {
        "events": json.dumps(api.get(f"{API}/events{query}").json()),
        "events?node": json.dumps(api.get(f"{API}/events?node={node.pk}").json()),
        "events?type=appeal": json.dumps(api.get(f"{API}/events?type=appeal").json()),
        "node events": json.dumps(api.get(f"{API}/nodes/{node.pk}/events").json()),
        # A node the user may not see is a 404 (nothing read).
        "recent_events": json.dumps(detail.json().get("recent_events") if detail.status_code == 200 else None),
    }


@pytest.fixture
def owned_node(owner):
    node, _ = make_schedulable_node()
    node.owner = owner
    node.save(update_fields=["owner"])
    return node


@pytest.fixture
def second_client():
    user = User.objects.create_user("rita-rival")
    user.groups.add(Group.objects.get_or_create(name=CLIENTS)[0])
    return user


@pytest.fixture
def appealed(owned_node, owner):
    maintenance.quarantine_node(node_id=owned_node.pk, reason="hash mismatch", evidence={}, actor=Actor.system("t"))
    appeal = appeals.appeal_create(owner=owner, node_id=owned_node.pk, statement=STATEMENT, actor=Actor.system("t"))
    appeals.appeal_resolve(
        appeal_id=appeal.pk, outcome="upheld", resolution=RESOLUTION, expected_version=1, actor=Actor.system("op")
    )
    assert NodeEvent.objects.filter(type=marketplace_events.APPEAL).count() == 2
    return owned_node


def test_clients_never_read_appeal_events_on_any_path(appealed, client_api, client_user):
    # Even a client whose lease ran on the node.
    make_lease(appealed, "my-job").__class__.objects.update(client=client_user)
    for path, text in _reads(client_api, appealed).items():
        assert "Bob" not in text and "replacement disk" not in text, path
        assert '"appeal"' not in text, path


def test_the_owner_and_operators_read_the_appeal_events(appealed, owner_api, operator_api):
    for api in (owner_api, operator_api):
        for path, text in _reads(api, appealed).items():
            assert "Bob" in text and "replacement disk" in text, path


def test_another_owner_reads_no_appeal_event(appealed, other_owner):
    for path, text in _reads(_api(other_owner), appealed).items():
        assert "Bob" not in text and "replacement disk" not in text, path


def test_an_owner_who_is_also_a_client_reads_no_appeal_of_anothers_node(appealed, other_owner):
    other_owner.groups.add(Group.objects.get_or_create(name=CLIENTS)[0])
    for path, text in _reads(_api(other_owner), appealed).items():
        assert "Bob" not in text and "replacement disk" not in text, path


@pytest.fixture
def drained(operator_api, owned_node, client_user, second_client):
    """A checkpoint drain of a node running one lease of each client."""
    Lease = make_lease(owned_node, "my-job").__class__
    mine = Lease.objects.get(workload_id="my-job")
    theirs = make_lease(owned_node, "their-job")
    Lease.objects.filter(pk=mine.pk).update(client=client_user)
    Lease.objects.filter(pk=theirs.pk).update(client=second_client)
    response = act(
        operator_api, owned_node, "drain", {"reason": "rack move", "policy": "checkpoint", "deadline_in": 3600}
    )
    assert response.status_code == 201, response.json()
    events = NodeEvent.objects.filter(node=owned_node, type=maintenance_events.DRAIN)
    assert any("checkpoint_leases" in e.data for e in events)
    assert any("waiting_on" in e.data for e in events)
    return owned_node, mine, theirs


def _drain_data(api, node) -> list[dict]:
    """The ``data`` of drain events on every surface."""
    found = []
    for url in (f"{API}/events?node={node.pk}", f"{API}/nodes/{node.pk}/events", f"{API}/events?type=drain"):
        found += [e["data"] for e in api.get(url).json()["results"] if e["type"] == "drain"]
    found += [e["data"] for e in api.get(f"{API}/nodes/{node.pk}").json()["recent_events"] if e["type"] == "drain"]
    return found


def _listed(data_list) -> set[str]:
    ids = set()
    for data in data_list:
        ids.update(data.get("checkpoint_leases", []))
        for item in data.get("waiting_on", []):
            ids.update(item.get("lease_ids", []))
    return ids


def test_a_client_reads_only_its_own_lease_ids_in_drain_events(drained, client_api, second_client):
    node, mine, theirs = drained
    data = _drain_data(client_api, node)
    assert any("checkpoint_leases" in d for d in data) and any("waiting_on" in d for d in data)
    assert _listed(data) == {str(mine.pk)}
    assert str(theirs.pk) not in json.dumps(data)
    rival = _drain_data(_api(second_client), node)
    assert _listed(rival) == {str(theirs.pk)}
    assert str(mine.pk) not in json.dumps(rival)


def test_operators_and_the_nodes_owner_read_every_lease_id_in_drain_events(drained, operator_api, owner_api):
    node, mine, theirs = drained
    for api in (operator_api, owner_api):
        assert _listed(_drain_data(api, node)) == {str(mine.pk), str(theirs.pk)}


def test_a_client_does_not_read_another_clients_spread_group_named_by_a_budget(owned_node, client_user, client_api):
    mine = make_lease(owned_node, "my-job", group="my-web")
    mine.__class__.objects.filter(pk=mine.pk).update(client=client_user)
    record_event(
        owned_node,
        maintenance_events.DRAIN,
        Actor.system("t"),
        reason="waiting on: disruption_budget",
        data={
            "waiting_on": [
                {
                    "code": "disruption_budget",
                    "message": "The disruption budget of acme-secret-db, my-web allows no more disruptions now",
                    "groups": ["acme-secret-db", "my-web"],
                    "lease_ids": [str(mine.pk), "00000000-0000-0000-0000-0000000000aa"],
                }
            ]
        },
    )
    surfaces = _drain_data(client_api, owned_node)
    assert len(surfaces) == 4
    for data in surfaces:
        assert data["waiting_on"][0]["groups"] == ["my-web"]
        assert data["waiting_on"][0]["lease_ids"] == [str(mine.pk)]
        assert "acme-secret-db" not in json.dumps(data)


def test_a_clients_events_cost_a_bounded_number_of_queries(client_api, client_user):
    """Which lease ids named by the page's events are the caller's own is one query per page,
    not one per event (30 drain events naming 30 leases)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from fleet.events import Actor, record_event
    from tests.factories import PoolFactory, make_schedulable_node
    from tests.maintenance_support import make_lease

    node, _ = make_schedulable_node(PoolFactory())
    for i in range(30):
        lease = make_lease(node, f"w-{i}")
        record_event(node, maintenance_events.DRAIN, Actor.system("t"), reason="x",
                     data={"drain_id": "d", "checkpoint_leases": [str(lease.pk)]})  # fmt: skip
    with CaptureQueriesContext(connection) as few:
        client_api.get("/api/v1/events?page_size=5")
    with CaptureQueriesContext(connection) as many:
        assert client_api.get("/api/v1/events?page_size=50").status_code == 200
    assert len(many.captured_queries) == len(few.captured_queries)
    with CaptureQueriesContext(connection) as detail:
        assert client_api.get(f"/api/v1/nodes/{node.pk}").status_code == 200
    assert len(detail.captured_queries) < 15
