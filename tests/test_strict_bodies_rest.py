"""Strict bodies and lists on the endpoints that read their input by hand (nodepool.api.strict,
nodepool.api.filters): an unknown member is 400 ``unknown_field``, a wrong JSON type a 400 naming
the member (never a 500, never ``str()``'d), a body that is not an object 400 ``malformed_body``,
an unknown list parameter 400 ``invalid_filter``; and nothing is written on a refusal."""

from __future__ import annotations

import pytest

from leases.models import Lease, LeaseCheckpoint, Shape
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
        ("renew", {"ttl_seconds": "60"}, "invalid_request"),
        ("release", {"outcome": "succeeded", "dry_run": True}, "unknown_field"),
        ("release", {"outcome": 5}, "invalid_request"),
        ("release", {"outcome": []}, "invalid_request"),
        ("release", {"reason": {}}, "invalid_request"),
        ("release", {"reason": 0}, "invalid_request"),
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
        ({"state": 5}, "invalid_request"),
        ({"state": "running", "message": 0}, "invalid_request"),
        ({"state": "running", "message": []}, "invalid_request"),
        ({"state": "checkpointed", "message": {}}, "invalid_request"),
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
        ({"workload_id": "job-1", "fencing_token": 1, "lease_secret": 5}, "invalid_request"),
        ("job-1", "malformed_body"),
    ],
)
def test_fencing_validate_refuses_unknown_members_and_wrong_types(client_api, placed, body, code):
    assert_problem(client_api.post("/api/v1/fencing/validate", body, format="json"), 400, code)


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"labels": {}}, "unknown_field"),
        ({"description": 5}, "invalid_request"),
        ({"description": {}}, "invalid_request"),
    ],
)
def test_shape_create_refuses_unknown_members_and_wrong_types(operator_api, changes, code):
    body = {"name": "large", "resources": {"cpu": "8"}, **changes}
    assert_problem(operator_api.post("/api/v1/shapes", body, format="json"), 400, code)
    assert_problem(operator_api.post("/api/v1/shapes", [body], format="json"), 400, "malformed_body")
    assert not Shape.objects.exists()
