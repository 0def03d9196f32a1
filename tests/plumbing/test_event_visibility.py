"""What the event stream tells whom: found while closing round 2 by reading the code.

* A quarantine event carried the whole evidence, operator-only notes included, and the node's
  owner reads its node's events (``GET /events``, ``GET /nodes/{id}/events``, ``GET /nodes/{id}``).
* A lease client read every node's events, so another client's lease events, with that lease's
  id, workload and fencing token: what ``POST /fencing/validate`` refuses to tell (issue 11).
"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Group, User

from fleet import event_types as fleet_events
from fleet.events import Actor, record_event
from fleet.models import NodeEvent
from maintenance import services as maintenance
from nodepool.api.permissions import CLIENTS
from tests.conftest import _api
from tests.factories import PoolFactory, make_schedulable_node
from tests.support import grant

pytestmark = pytest.mark.django_db
API = "/api/v1"
EVIDENCE = {"hash": "abc", "private": {"informant": "tip-line"}, "ip_log": ["10.0.0.9"], "private_keys": ["ip_log"]}


def texts(api, node) -> list[str]:
    """What ``api``'s user reads about ``node`` on the three event surfaces, as JSON text."""
    return [
        json.dumps(api.get(f"{API}/events").json()),
        json.dumps(api.get(f"{API}/nodes/{node.pk}/events").json()),
        json.dumps(api.get(f"{API}/nodes/{node.pk}").json()),
    ]


def test_the_owner_reads_the_quarantine_event_without_the_private_evidence(owner, owner_api, operator_api):
    node, _ = make_schedulable_node()
    node.owner = owner
    node.save(update_fields=["owner"])
    maintenance.quarantine_node(node_id=node.pk, reason="hash mismatch", evidence=EVIDENCE,
                                actor=Actor.system("test"))  # fmt: skip
    for text in texts(owner_api, node):
        assert "hash mismatch" in text or "quarantine" in text
        assert "tip-line" not in text and "10.0.0.9" not in text
    event = NodeEvent.objects.get(node=node, type="quarantine")
    assert event.data["evidence"] == {"hash": "abc"}
    # Operators still read the whole evidence, on the quarantine itself.
    [quarantine] = operator_api.get(f"{API}/quarantines").json()["results"]
    assert quarantine["evidence"]["private"] == {"informant": "tip-line"}


def test_a_client_reads_node_events_and_its_own_lease_events_but_not_another_clients(client_user, client_api):
    node, _ = make_schedulable_node(PoolFactory(name="general"))
    rival = User.objects.create_user("rita-rival")
    rival.groups.add(Group.objects.get_or_create(name=CLIENTS)[0])
    theirs = grant(rival, "their-job", cpu="1")
    mine = grant(client_user, "my-job", cpu="1")
    assert theirs.node_id == mine.node_id == node.pk
    record_event(node, fleet_events.LIVENESS, Actor.system("test"), from_state="alive", to_state="stale")

    for text in texts(client_api, node):
        assert "their-job" not in text and str(theirs.pk) not in text
    events = client_api.get(f"{API}/events").json()["results"]
    assert any(e["lease_id"] == str(mine.pk) for e in events)  # its own lease's grant
    assert any(e["node_id"] == str(node.pk) and e["lease_id"] is None for e in events)  # node events
    recent = client_api.get(f"{API}/nodes/{node.pk}").json()["recent_events"]
    assert any((e["data"] or {}).get("lease_id") == str(mine.pk) for e in recent)
    # The rival reads its own, not this client's.
    rival_text = json.dumps(_api(rival).get(f"{API}/events").json())
    assert str(theirs.pk) in rival_text and "my-job" not in rival_text
