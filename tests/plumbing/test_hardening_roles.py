"""Role boundaries across the whole API: who may not do what, and that a refusal changes nothing.

Clients may not use operator endpoints, an owner never sees another owner's node (or its drain,
quarantine or leases), and a node credential works only on its own node's agent endpoints.
"""

from __future__ import annotations

import pytest
from django.core.cache import cache
from rest_framework.test import APIClient

from fleet.choices import Lifecycle
from fleet.models import BootstrapToken, Node, NodeEvent, Pool
from leases.models import Lease, Shape
from maintenance.models import DisruptionBudget, Drain, Quarantine
from tests.factories import PoolFactory, make_schedulable_node, set_lifecycle
from tests.maintenance_support import act, make_lease
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_throttle_counts():
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def world(operator_api, owner, other_owner):
    """Two owners' nodes (one draining, one quarantined) and a general node holding a lease."""
    pool = PoolFactory(name="general")
    general, general_secret = make_schedulable_node(pool)
    mine, mine_secret = make_schedulable_node(pool, owner=owner)
    theirs, _ = make_schedulable_node(pool, owner=other_owner)
    theirs_quarantined, _ = make_schedulable_node(pool, owner=other_owner)
    assert act(operator_api, theirs, "drain", {"reason": "r", "deadline_in": 3600}).status_code == 201
    assert act(operator_api, theirs_quarantined, "quarantine", {"reason": "r"}).status_code == 200
    lease = make_lease(general, "job-1")
    return {
        "pool": pool,
        "general": general,
        "general_secret": general_secret,
        "mine": mine,
        "mine_secret": mine_secret,
        "theirs": theirs,
        "theirs_quarantined": theirs_quarantined,
        "drain": Drain.objects.get(node=theirs),
        "quarantine": Quarantine.objects.get(node=theirs_quarantined),
        "lease": lease,
    }


def state() -> tuple:
    """Everything a refused request must leave alone."""
    return (
        sorted(Node.objects.values_list("pk", "version", "lifecycle")),
        Pool.objects.count(),
        BootstrapToken.objects.count(),
        sorted(Lease.objects.values_list("pk", "state", "fencing_token")),
        Drain.objects.count(),
        Quarantine.objects.count(),
        DisruptionBudget.objects.count(),
        Shape.objects.count(),
        NodeEvent.objects.count(),
    )


OPERATOR_ONLY = [
    ("post", "/api/v1/pools", {"name": "new-pool"}),
    ("patch", "/api/v1/pools/general", {"description": "x"}),
    ("delete", "/api/v1/pools/general", None),
    ("get", "/api/v1/bootstrap-tokens", None),
    ("post", "/api/v1/bootstrap-tokens", {"pool": "general", "max_uses": 1, "ttl_seconds": 600}),
    ("post", "/api/v1/nodes/{general}/admit", {"reason": "r"}),
    ("post", "/api/v1/nodes/{general}/cordon", {"reason": "r"}),
    ("post", "/api/v1/nodes/{general}/uncordon", {"reason": "r"}),
    ("post", "/api/v1/nodes/{general}/drain", {"reason": "r"}),
    ("post", "/api/v1/nodes/{general}/quarantine", {"reason": "r"}),
    ("post", "/api/v1/nodes/{general}/release", {"reason": "r"}),
    ("post", "/api/v1/nodes/{general}/return-to-service", {"reason": "r"}),
    ("post", "/api/v1/nodes/{general}/retire", {"reason": "r", "force": True}),
    ("post", "/api/v1/nodes/{general}/credentials", {"reason": "r"}),
    ("post", "/api/v1/nodes/{general}/credentials/revoke", {"reason": "r"}),
    ("post", "/api/v1/drains/{drain}/cancel", {"reason": "r"}),
    ("post", "/api/v1/drains/{drain}/deadline", {"reason": "r", "deadline_in": 60}),
    ("post", "/api/v1/disruption-budgets", {"group": "web", "max_unavailable": 1}),
    ("post", "/api/v1/shapes", {"name": "small", "resources": {"cpu": "1"}}),
    ("get", "/api/v1/lease-consistency-reports", None),
]


def call(api, world, method: str, template: str, body):
    path = template.format(
        general=world["general"].pk, drain=world["drain"].pk, mine=world["mine"].pk, theirs=world["theirs"].pk
    )
    # The version is right: only the role may be the reason for refusing.
    node = world["general"]
    node.refresh_from_db()
    kwargs = {"format": "json", "HTTP_IF_MATCH": f'"{node.version}"'}
    return getattr(api, method)(path, body, **kwargs) if body is not None else getattr(api, method)(path, **kwargs)


@pytest.mark.parametrize(("method", "template", "body"), OPERATOR_ONLY, ids=[f"{m} {p}" for m, p, _ in OPERATOR_ONLY])
@pytest.mark.parametrize("who", ["client", "owner", "node"])
def test_operator_endpoints_refuse_clients_owners_and_nodes_and_change_nothing(
    world, client_api, owner_api, method, template, body, who
):
    api = {"client": client_api, "owner": owner_api}.get(who)
    if who == "node":
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Node {world['general_secret']}")
    before = state()

    response = call(api, world, method, template, body)

    assert_problem(response, 403, "forbidden")
    assert state() == before


@pytest.mark.parametrize(
    "template",
    ["/api/v1/nodes/{theirs}", "/api/v1/drains/{drain}", "/api/v1/quarantines/{quarantine}"],
)
def test_an_owner_cannot_see_another_owners_node_drain_or_quarantine(world, owner_api, template):
    path = template.format(theirs=world["theirs"].pk, drain=world["drain"].pk, quarantine=world["quarantine"].pk)

    assert_problem(owner_api.get(path), 404, "not_found")


def test_an_owner_lists_only_their_own_nodes_and_no_drains_quarantines_or_leases_of_others(world, owner_api):
    nodes = owner_api.get("/api/v1/nodes").json()["results"]

    assert [n["id"] for n in nodes] == [str(world["mine"].pk)]
    assert owner_api.get("/api/v1/drains").json()["count"] == 0
    assert owner_api.get("/api/v1/quarantines").json()["count"] == 0
    assert_problem(owner_api.get("/api/v1/node-leases"), 403, "forbidden")
    assert_problem(owner_api.get(f"/api/v1/node-leases/{world['lease'].pk}"), 403, "forbidden")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("heartbeats", {"incarnation": 1, "sequence": 1, "observed_at": "2026-11-29T09:00:00Z"}),
        ("metrics", {"observed_at": "2026-11-29T09:00:00Z"}),
        ("credentials/rotate", {}),
        ("benchmarks/nonce1", {"cpu_millicores": 1, "memory_bytes": 1}),
    ],
)
def test_a_node_credential_is_refused_on_another_nodes_agent_endpoints(world, path, body):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Node {world['mine_secret']}")
    before = state()

    response = api.post(f"/api/v1/nodes/{world['general'].pk}/{path}", body, format="json")

    assert_problem(response, 403)
    assert state() == before


@pytest.mark.parametrize(
    "path", ["/api/v1/nodes", "/api/v1/nodes/{own}", "/api/v1/node-leases", "/api/v1/drains", "/api/v1/pools"]
)
def test_a_node_credential_reads_nothing_through_the_user_api(world, path):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Node {world['mine_secret']}")

    assert_problem(api.get(path.format(own=world["mine"].pk)), 403, "forbidden")


def test_a_node_cannot_report_on_a_lease_held_by_another_node(world):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Node {world['mine_secret']}")
    lease = world["lease"]
    before = state()

    response = api.post(
        f"/api/v1/node-leases/{lease.pk}/events",
        {"state": "running", "fencing_token": lease.fencing_token, "node_incarnation": world["mine"].incarnation},
        format="json",
    )

    assert_problem(response, 404, "lease_not_found")
    assert state() == before
    lease.refresh_from_db()
    assert lease.workload_state == ""


def test_a_retired_node_is_still_invisible_to_other_owners(world, operator_api, owner_api):
    set_lifecycle(world["theirs_quarantined"], Lifecycle.RETIRED)

    assert_problem(owner_api.get(f"/api/v1/nodes/{world['theirs_quarantined'].pk}"), 404, "not_found")
