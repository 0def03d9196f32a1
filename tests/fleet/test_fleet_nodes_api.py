import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from fleet.choices import Lifecycle
from fleet.credentials import issue_credential
from fleet.events import Actor, record_event
from fleet.models import AdmissionCheck, Node
from nodepool.api.versioning import etag_for
from tests.factories import NodeFactory, make_schedulable_node, set_capacity, set_lifecycle
from tests.fleet_support import make_pool

pytestmark = pytest.mark.django_db
NODES = "/api/v1/nodes"


def _busy_node(pool, **fields):
    """A node with inventory, checks, events and a credential: everything the API renders."""
    node = NodeFactory(pool=pool, **fields)
    set_capacity(node, {"cpu": 8000, "memory": 2**34}, reserved={"cpu": 500})
    AdmissionCheck.objects.create(node=node, attempt=0, name="plausibility", status="passed")
    for i in range(3):
        record_event(node, "policy", Actor.system("t"), reason=f"e{i}")
    issue_credential(node=node, issuer="test")
    return node


def test_node_detail_shows_every_dimension(operator_api):
    node, _ = make_schedulable_node(make_pool(name="general"), labels={"zone": "a"})
    response = operator_api.get(f"{NODES}/{node.pk}")
    assert response.status_code == 200
    ages = ("status_report_age_seconds",)  # the clock's, not the node's: left out of the ETag
    assert response["ETag"] == etag_for(node.version, {k: v for k, v in response.json().items() if k not in ages})
    body = response.json()
    for key in ("lifecycle", "liveness", "ready", "health", "conditions", "incarnation", "version", "pool"):
        assert key in body
    assert body["schedulable"] is True and body["unschedulable_reasons"] == []
    assert body["capacity"]["cpu"] == {
        "capacity": 8000, "reserved": 0, "allocatable": 8000, "allocated": 0, "free": 8000, "overcommitted": False
    }  # fmt: skip
    assert set(body["capability"]) == {"declared", "measured", "verified"}
    assert body["pool"] == "general"


def test_unschedulable_reasons_are_listed(operator_api):
    node = NodeFactory()
    body = operator_api.get(f"{NODES}/{node.pk}").json()
    assert body["schedulable"] is False
    codes = {r["code"] for r in body["unschedulable_reasons"]}
    assert codes == {"lifecycle_not_ready", "not_alive", "node_not_ready", "unhealthy", "no_valid_credential"}


def test_list_filters_by_pool_lifecycle_liveness_owner_and_label(client_api, owner):
    general, gpu = make_pool(name="general"), make_pool(name="gpu")
    a, _ = make_schedulable_node(general, labels={"topology.kubernetes.io/zone": "a"})
    b, _ = make_schedulable_node(gpu, labels={"topology.kubernetes.io/zone": "b", "accel": "a16"})
    c = set_lifecycle(NodeFactory(pool=general, owner=owner), "rejected")

    def ids(query):
        response = client_api.get(f"{NODES}?{query}")
        assert response.status_code == 200, response.json()
        return {n["id"] for n in response.json()["results"]}

    assert ids("pool=general") == {str(a.pk), str(c.pk)}
    assert ids("lifecycle=ready") == {str(a.pk), str(b.pk)}
    assert ids("lifecycle=ready&lifecycle=rejected") == {str(a.pk), str(b.pk), str(c.pk)}
    assert ids("liveness=alive") == {str(a.pk), str(b.pk)}
    assert ids(f"owner={owner.username}") == {str(c.pk)}
    assert ids("label=topology.kubernetes.io/zone=b") == {str(b.pk)}
    assert ids("label=accel") == {str(b.pk)}
    assert ids("label=topology.kubernetes.io/zone=b&label=accel=x") == set()
    assert ids("schedulable=true") == {str(a.pk), str(b.pk)}
    assert ids("schedulable=false") == {str(c.pk)}


@pytest.mark.parametrize(
    "query", ["lifecycle=sleeping", "liveness=maybe", "label=bad key!=x", "schedulable=perhaps", "page=99"]
)
def test_bad_filters_are_4xx(client_api, query):
    NodeFactory()
    response = client_api.get(f"{NODES}?{query}")
    assert 400 <= response.status_code < 500
    assert response["Content-Type"] == "application/problem+json"


def test_list_is_paginated_with_a_constant_number_of_queries(operator_api):
    pool = make_pool(name="general")
    _busy_node(pool)

    def count_queries() -> int:
        with CaptureQueriesContext(connection) as ctx:
            response = operator_api.get(f"{NODES}?page_size=50")
        assert response.status_code == 200
        return len(ctx.captured_queries)

    few = count_queries()
    for _ in range(6):
        _busy_node(pool)
    many = count_queries()
    assert few == many, (few, many)
    body = operator_api.get(f"{NODES}?page_size=3").json()
    assert body["count"] == 7 and len(body["results"]) == 3 and body["next"]
    assert len(body["results"][0]["recent_events"]) == 3


def test_owner_sees_only_their_own_nodes_with_reasons(owner_api, owner, other_owner):
    mine = set_lifecycle(NodeFactory(owner=owner), "quarantined")
    Node.objects.filter(pk=mine.pk).update(lifecycle_reason="impossible usage reported")
    rejected = set_lifecycle(NodeFactory(owner=owner), Lifecycle.REJECTED)
    theirs = NodeFactory(owner=other_owner)
    unowned = NodeFactory()

    listing = owner_api.get(NODES).json()
    assert {n["id"] for n in listing["results"]} == {str(mine.pk), str(rejected.pk)}
    detail = owner_api.get(f"{NODES}/{mine.pk}").json()
    assert detail["lifecycle"] == "quarantined" and detail["lifecycle_reason"] == "impossible usage reported"
    assert detail["credentials"] is None
    assert owner_api.get(f"{NODES}/{theirs.pk}").status_code == 404
    assert owner_api.get(f"{NODES}/{unowned.pk}").status_code == 404
    assert owner_api.get(f"{NODES}?owner={theirs.owner.username}").json()["count"] == 0


def test_users_without_a_role_and_anonymous_callers_see_nothing(anon_api, django_user_model):
    NodeFactory()
    assert anon_api.get(NODES).status_code == 401
    from tests.conftest import _api

    nobody = _api(django_user_model.objects.create_user("nobody"))
    assert nobody.get(NODES).status_code == 403


def test_unknown_node_and_malformed_id_are_404(operator_api):
    assert operator_api.get(f"{NODES}/00000000-0000-0000-0000-000000000000").status_code == 404
    assert operator_api.get(f"{NODES}/not-a-uuid").status_code == 404


def test_nodes_are_read_only_through_this_endpoint(operator_api):
    node = NodeFactory()
    assert operator_api.patch(f"{NODES}/{node.pk}", {"lifecycle": "ready"}, format="json").status_code == 405
    assert operator_api.delete(f"{NODES}/{node.pk}").status_code == 405
    assert operator_api.post(NODES, {}, format="json").status_code == 405
