"""Strict bodies and lists on the endpoints that read their input by hand (nodepool.api.strict,
nodepool.api.filters): an unknown member is 400 ``unknown_field``, a wrong JSON type a 400 naming
the member (never a 500, never ``str()``'d), a body that is not an object 400 ``malformed_body``,
an unknown list parameter 400 ``invalid_filter``; and nothing is written on a refusal."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from leases.models import Lease, LeaseCheckpoint, Shape
from operations.models import Preemption, ProviderMachine, Upgrade
from operations.upgrade_plan import pool_operations
from tests.factories import PoolFactory, make_schedulable_node
from tests.problems import assert_problem
from tests.support import lease_body, node_api

pytestmark = pytest.mark.django_db


# --- leases --------------------------------------------------------------------------------------
@pytest.fixture
def placed(client_api):
    """A granted lease of ``client_api``, with its node's credential."""
    node, secret = make_schedulable_node(PoolFactory(name="general"))
    answer = client_api.post("/api/v1/node-leases", lease_body(command=["sleep", "30"]), format="json")
    assert answer.status_code == 201, answer.json()
    return Lease.objects.get(pk=answer.json()["id"]), secret


def _fence(lease: Lease, **changes) -> dict:
    return {"fencing_token": lease.fencing_token, "node_incarnation": lease.node_incarnation, **changes}


def _unchanged(lease: Lease) -> None:
    before = (lease.state, lease.version, lease.expires_at, lease.workload_state)
    lease.refresh_from_db()
    assert (lease.state, lease.version, lease.expires_at, lease.workload_state) == before


@pytest.mark.parametrize(
    ("action", "changes", "code"),
    [
        ("renew", {"ttl": 60}, "unknown_field"),
        ("renew", {"ttl_seconds": "60"}, "validation_error"),
        ("release", {"outcome": "succeeded", "dry_run": True}, "unknown_field"),
        ("release", {"outcome": 5}, "validation_error"),
        ("release", {"outcome": []}, "validation_error"),
        ("release", {"reason": {}}, "validation_error"),
        ("release", {"reason": 0}, "validation_error"),
    ],
)
def test_lease_renew_and_release_refuse_unknown_members_and_wrong_types(client_api, placed, action, changes, code):
    lease, _ = placed
    response = client_api.post(f"/api/v1/node-leases/{lease.pk}/{action}", _fence(lease, **changes), format="json")
    body = assert_problem(response, 400, code)
    if code == "unknown_field":
        assert body["fields"] == sorted(set(changes) - {"outcome"})
    _unchanged(lease)


@pytest.mark.parametrize("action", ["renew", "release"])
def test_lease_renew_and_release_refuse_a_body_that_is_not_an_object(client_api, placed, action):
    lease, _ = placed
    response = client_api.post(f"/api/v1/node-leases/{lease.pk}/{action}", [1], format="json")
    assert_problem(response, 400, "malformed_body")
    _unchanged(lease)


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"state": "running", "exit_code": 0}, "unknown_field"),
        ({"state": 5}, "validation_error"),
        ({"state": "running", "message": 0}, "validation_error"),
        ({"state": "running", "message": []}, "validation_error"),
        ({"state": "checkpointed", "message": {}}, "validation_error"),
    ],
)
def test_lease_events_refuse_unknown_members_and_wrong_types(placed, changes, code):
    lease, secret = placed
    response = node_api(secret).post(f"/api/v1/node-leases/{lease.pk}/events", _fence(lease, **changes), format="json")
    assert_problem(response, 400, code)
    _unchanged(lease)
    assert not LeaseCheckpoint.objects.exists()


def test_a_lease_checkpoint_request_refuses_an_unknown_member(operator_api, placed):
    lease, _ = placed
    response = operator_api.post(
        f"/api/v1/node-leases/{lease.pk}/checkpoint", {"expected_version": lease.version, "now": True}, format="json"
    )
    assert assert_problem(response, 400, "unknown_field")["fields"] == ["now"]
    lease.refresh_from_db()
    assert lease.checkpoint_requested_at is None
    assert not LeaseCheckpoint.objects.exists()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"workload_id": "job-1", "fencing_token": 1, "token": 1}, "unknown_field"),
        ({"lease_secret": "npls.x", "workload": "job-1"}, "unknown_field"),
        ({"workload_id": "job-1", "fencing_token": 1, "lease_secret": 5}, "validation_error"),
        ("job-1", "malformed_body"),
    ],
)
def test_fencing_validate_refuses_unknown_members_and_wrong_types(client_api, placed, body, code):
    assert_problem(client_api.post("/api/v1/fencing/validate", body, format="json"), 400, code)


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"labels": {}}, "unknown_field"),
        ({"description": 5}, "validation_error"),
        ({"description": {}}, "validation_error"),
    ],
)
def test_shape_create_refuses_unknown_members_and_wrong_types(operator_api, changes, code):
    body = {"name": "large", "resources": {"cpu": "8"}, **changes}
    assert_problem(operator_api.post("/api/v1/shapes", body, format="json"), 400, code)
    assert_problem(operator_api.post("/api/v1/shapes", [body], format="json"), 400, "malformed_body")
    assert not Shape.objects.exists()


# --- pool operations -----------------------------------------------------------------------------
UPGRADE_TARGET = {"version": "2.0.0"}


def _deadline(seconds: int = 30) -> str:
    return (timezone.now() + timedelta(seconds=seconds)).isoformat()


@pytest.fixture
def spot(operator_api):
    """A spot pool ``spot`` (falling back to ``ondemand``) with one node: ``(node, secret)``."""
    PoolFactory(name="ondemand")
    pool = PoolFactory(name="spot")
    response = operator_api.patch(
        "/api/v1/pools/spot/operations", {"spot": True, "fallback_pool": "ondemand"}, format="json", HTTP_IF_MATCH='"1"'
    )
    assert response.status_code == 200, response.content
    pool.refresh_from_db()
    return make_schedulable_node(pool, taints=list(pool.taints))


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"canary_pool": 5}, "validation_error"),
        ({"canary_pool": ["ondemand"]}, "validation_error"),
        ({"auto_rollback": "yes"}, "validation_error"),
    ],
)
def test_an_upgrade_body_refuses_wrong_types(operator_api, spot, changes, code):
    PoolFactory(name="5")  # a pool whose name is the number's str(): never matched by a number
    body = {"pool": "spot", "target": UPGRADE_TARGET, **changes}
    assert_problem(operator_api.post("/api/v1/upgrades", body, format="json"), 400, code)
    assert not Upgrade.objects.exists()


@pytest.mark.parametrize(
    ("body", "code"),
    [({"reason": "go", "force": True}, "unknown_field"), ([], "malformed_body"), ("go", "malformed_body")],
)
def test_an_upgrade_action_refuses_unknown_members_and_a_body_that_is_not_an_object(operator_api, spot, body, code):
    created = operator_api.post("/api/v1/upgrades", {"pool": "spot", "target": UPGRADE_TARGET}, format="json").json()
    response = operator_api.post(
        f"/api/v1/upgrades/{created['id']}/start", body, format="json", HTTP_IF_MATCH=f'"{created["version"]}"'
    )
    assert_problem(response, 400, code)
    upgrade = Upgrade.objects.get(pk=created["id"])
    assert (upgrade.state, upgrade.version) == ("pending", created["version"])


def test_pool_operations_refuse_a_fallback_pool_that_is_not_a_name(operator_api, spot):
    PoolFactory(name="7")
    before = pool_operations(spot[0].pool).version
    response = operator_api.patch(
        "/api/v1/pools/spot/operations", {"fallback_pool": 7}, format="json", HTTP_IF_MATCH=f'"{before}"'
    )
    assert_problem(response, 400)
    ops = pool_operations(spot[0].pool)
    assert (ops.version, ops.fallback_pool.name) == (before, "ondemand")


@pytest.mark.parametrize(
    ("changes", "code"),
    [({"reason": "reclaimed"}, "unknown_field"), ({"deadline": 5}, "invalid_deadline"), (None, "malformed_body")],
)
def test_a_nodes_preemption_notice_refuses_unknown_members_and_wrong_types(spot, changes, code):
    node, secret = spot
    body = [_deadline()] if changes is None else {"deadline": _deadline(), **changes}
    response = node_api(secret).post(f"/api/v1/nodes/{node.pk}/preemption-notice", body, format="json")
    assert_problem(response, 400, code)
    assert not Preemption.objects.exists()
    node.refresh_from_db()
    assert node.lifecycle == "ready"


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"reason": "reclaimed"}, "unknown_field"),
        ({"delivery_id": 5}, "validation_error"),
        ({"node_id": 5}, "invalid_node_id"),
    ],
)
def test_a_pools_preemption_notice_refuses_unknown_members_and_wrong_types(operator_api, spot, changes, code):
    node, _ = spot
    body = {"node_id": str(node.pk), "deadline": _deadline(), **changes}
    response = operator_api.post("/api/v1/pools/spot/preemption-notices", body, format="json")
    assert_problem(response, 400, code)
    assert not Preemption.objects.exists()


@pytest.mark.parametrize(
    "url",
    [
        "/api/v1/pools/spot/preemptions?days=7&page=2",
        "/api/v1/pools/spot/preemptions?dayz=7",
        "/api/v1/machines?pool=spot&state=running",
        "/api/v1/machines?pools=spot",
    ],
)
def test_preemptions_and_machines_refuse_an_unknown_parameter(operator_api, spot, url):
    body = assert_problem(operator_api.get(url), 400, "invalid_filter")
    assert body["errors"][0]["code"] == "unknown_filter"


def test_preemptions_and_machines_still_take_their_parameters(operator_api, spot):
    ProviderMachine.objects.create(pool=spot[0].pool, name="m-1", provider="simulated", requested_at=timezone.now())
    assert operator_api.get("/api/v1/pools/spot/preemptions?days=3&format=json").status_code == 200
    machines = operator_api.get("/api/v1/machines?pool=spot&page_size=5")
    assert machines.status_code == 200, machines.content
    assert [m["name"] for m in machines.json()["results"]] == ["m-1"]
    assert operator_api.get("/api/v1/machines?pool=elsewhere").json()["results"] == []
    assert_problem(operator_api.get("/api/v1/machines?pool="), 400, "invalid_filter")


# --- marketplace ---------------------------------------------------------------------------------
@pytest.fixture
def market(owner):
    """A priced pool ``market`` and a node of ``owner`` in it."""
    from tests.marketplace_support import owned_node, priced_pool

    pool = priced_pool()
    return pool, owned_node(pool, owner, "mine")[0]


def _stored_marketplace() -> tuple:
    from marketplace.models import Appeal, OwnerSettings, PoolPrice, PoolSettlement, QuarantineGuidance

    return tuple(m.objects.count() for m in (Appeal, OwnerSettings, PoolPrice, PoolSettlement, QuarantineGuidance))


PRICE = {"pool": "market", "resource": "gpu.example/a", "unit_price": "1.5", "currency": "EUR",
         "effective_from": "2027-01-01T00:00:00Z"}  # fmt: skip


@pytest.mark.parametrize(
    ("method", "url", "body", "code"),
    [
        ("post", "/api/v1/pool-prices", {**PRICE, "unit": "hour"}, "unknown_field"),
        ("post", "/api/v1/pool-prices", {**PRICE, "note": 5}, "validation_error"),
        ("put", "/api/v1/pools/market/settlement", {"settlement_window": 7200, "window": 1}, "unknown_field"),
        ("put", "/api/v1/owner-settings/oscar-owner", {"statement_period": "week", "owner": "x"}, "unknown_field"),
        ("put", "/api/v1/owner-settings/oscar-owner", {"statement_period": 7}, "validation_error"),
        ("put", "/api/v1/quarantine-guidance/manual", {"next_steps": "Reinstall.", "rule": "x"}, "unknown_field"),
        ("put", "/api/v1/quarantine-guidance/manual", {"next_steps": ["Reinstall."]}, "validation_error"),
    ],
)
def test_marketplace_operator_bodies_refuse_unknown_members_and_wrong_types(
    operator_api, owner, market, method, url, body, code
):
    before = _stored_marketplace()
    body = assert_problem(getattr(operator_api, method)(url, body, format="json"), 400, code)
    if code == "unknown_field":
        assert len(body["fields"]) == 1
    assert _stored_marketplace() == before


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"statement": "It was a disk error.", "node_id": "x"}, "unknown_field"),
        ({"statement": 5}, "validation_error"),
        ({"statement": {}}, "validation_error"),
    ],
)
def test_an_appeal_refuses_unknown_members_and_wrong_types(owner_api, market, body, code):
    from fleet.events import Actor
    from maintenance import services as maintenance
    from marketplace.models import Appeal

    _, node = market
    maintenance.quarantine_node(node_id=node.pk, reason="r", evidence={}, actor=Actor.system("test"))
    assert_problem(owner_api.post("/api/v1/appeals", {"node": str(node.pk), **body}, format="json"), 400, code)
    assert not Appeal.objects.exists()


def test_resolving_an_appeal_refuses_unknown_members(operator_api, owner_api, market):
    from fleet.events import Actor
    from maintenance import services as maintenance
    from marketplace.models import Appeal

    _, node = market
    maintenance.quarantine_node(node_id=node.pk, reason="r", evidence={}, actor=Actor.system("test"))
    owner_api.post("/api/v1/appeals", {"node": str(node.pk), "statement": "disk"}, format="json")
    appeal = Appeal.objects.get()
    body = {"outcome": "overturned", "resolution": "ok", "release": False}
    response = operator_api.post(f"/api/v1/appeals/{appeal.pk}/resolve", body, format="json", HTTP_IF_MATCH='"1"')
    assert assert_problem(response, 400, "unknown_field")["fields"] == ["release"]
    appeal.refresh_from_db()
    node.refresh_from_db()
    assert (appeal.state, node.lifecycle) == ("open", "quarantined")


@pytest.mark.parametrize(
    "query",
    [
        "usage-records?stat=disputed",
        "usage-records?state=pending&owner=x",
        "usage-records?state=",
        "statements?state=open&period=month",
        "statements?state=closed",
        "appeals?state=open&node=x",
        "appeals?state=",
        "owned-leases?nodes=x",
        "owned-leases?node=not-a-uuid",
    ],
)
def test_marketplace_lists_refuse_unknown_parameters_and_bad_values(owner_api, market, query):
    assert_problem(owner_api.get(f"/api/v1/{query}"), 400, "invalid_filter")


@pytest.mark.parametrize(
    "query",
    [
        "usage-records?state=pending&state=disputed&page_size=5",
        "statements?state=open&page=1",
        "appeals?state=open&format=json",
        "owned-leases?state=active&node=00000000-0000-0000-0000-000000000000",
    ],
)
def test_marketplace_lists_still_take_their_filters_and_pages(owner_api, market, query):
    response = owner_api.get(f"/api/v1/{query}")
    assert response.status_code == 200, response.content
    assert response.json()["results"] == []


# --- pools, disruption budgets, node actions' query parameters -----------------------------------
@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"name": "general", "admission": "automatic"}, "unknown_field"),
        ({"name": "general", "version": 3}, "unknown_field"),
        ({"name": "general", "description": 5}, "validation_error"),
        ({"name": 5}, "validation_error"),
    ],
)
def test_a_pool_body_refuses_unknown_members_and_numbers_for_strings(operator_api, body, code):
    from fleet.models import Pool

    assert_problem(operator_api.post("/api/v1/pools", body, format="json"), 400, code)
    assert not Pool.objects.exists()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"group": "web", "max_unavailable": 1, "max_surge": 1}, "unknown_field"),
        ({"group": 5, "max_unavailable": 1}, "validation_error"),
        ({"group": "web", "max_unavailable": 1, "description": 5}, "validation_error"),
    ],
)
def test_a_disruption_budget_body_refuses_unknown_members_and_numbers_for_strings(operator_api, body, code):
    from maintenance.models import DisruptionBudget

    created = operator_api.post("/api/v1/disruption-budgets", {"group": "db", "max_unavailable": 1}, format="json")
    assert created.status_code == 201, created.content
    assert_problem(operator_api.post("/api/v1/disruption-budgets", body, format="json"), 400, code)
    url = f"/api/v1/disruption-budgets/{created.json()['id']}"
    assert_problem(operator_api.patch(url, body, format="json", HTTP_IF_MATCH='"1"'), 400, code)
    budget = DisruptionBudget.objects.get()
    assert (budget.group, budget.version, budget.description) == ("db", 1, "")


@pytest.mark.parametrize("query", ["pools?kinds=spot", "pools?kind=nope", "disruption-budgets?grp=web"])
def test_pools_and_disruption_budgets_refuse_unknown_parameters(operator_api, query):
    assert_problem(operator_api.get(f"/api/v1/{query}"), 400, "invalid_filter")


def test_pools_and_disruption_budgets_still_filter(operator_api):
    PoolFactory(name="general")
    assert [p["name"] for p in operator_api.get("/api/v1/pools?kind=standard&page=1").json()["results"]] == ["general"]
    assert operator_api.get("/api/v1/disruption-budgets?group=web&page_size=2").json()["results"] == []


@pytest.mark.parametrize(
    ("action", "query"), [("drain", "dryrun=true"), ("drain", "dry_run=true&x=1"), ("cordon", "dry_run=true")]
)
def test_a_node_action_refuses_a_query_parameter_it_does_not_read(operator_api, action, query):
    from maintenance.models import Drain

    node, _ = make_schedulable_node(PoolFactory())
    drain = {"reason": "kernel", "policy": "wait", "deadline_in": 3600}
    body = drain if action == "drain" else {"reason": "kernel"}
    response = operator_api.post(f"/api/v1/nodes/{node.pk}/{action}?{query}", body, format="json", HTTP_IF_MATCH='"1"')
    assert_problem(response, 400, "invalid_filter")
    node.refresh_from_db()
    assert (node.lifecycle, node.cordoned, node.version) == ("ready", False, 1)
    assert not Drain.objects.exists()
    planned = operator_api.post(f"/api/v1/nodes/{node.pk}/drain?dry_run=true", drain, format="json")
    assert planned.status_code == 200, planned.content


def test_the_consistency_reports_list_refuses_any_parameter_but_a_pages(operator_api):
    assert_problem(operator_api.get("/api/v1/lease-consistency-reports?node=x"), 400, "invalid_filter")
    assert operator_api.get("/api/v1/lease-consistency-reports?page_size=5").status_code == 200
