"""Strict request bodies (nodepool.api.strict): strings are JSON strings, nested objects objects."""

from __future__ import annotations

import pytest

from fleet.models import Node
from tests.factories import PoolFactory, make_schedulable_node
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db


def _enrollment(token: str, **changes) -> dict:
    body = {
        "bootstrap_token": token, "hostname": "h1", "agent_version": "1.0.0",
        "capability": {"resources": {"cpu": "2", "memory": "4Gi"}, "features": {"arch": "amd64", "os": "linux"}},
    }  # fmt: skip
    body.update(changes)
    return body


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"agent_version": 5}, "agent_version"), ({"hostname": 7}, "hostname"), ({"attestation": "x"}, "attestation")],
)
def test_enrollment_refuses_a_number_for_a_string_and_a_string_for_an_object(operator_api, anon_api, changes, field):
    pool = PoolFactory(name="general", admission_mode="automatic")
    token = operator_api.post(
        "/api/v1/bootstrap-tokens", {"pool": pool.name, "max_uses": 5, "ttl_seconds": 3600}, format="json"
    ).json()["token"]
    response = anon_api.post("/api/v1/node-enrollments", _enrollment(token, **changes), format="json")
    assert_problem(response, 400, "validation_error")
    assert field in {error["field"].split(".")[0] for error in response.json()["errors"]}
    assert not Node.objects.exists()


def test_an_action_reason_must_be_a_string(operator_api):
    node, _ = make_schedulable_node(PoolFactory())
    response = operator_api.post(f"/api/v1/nodes/{node.pk}/cordon", {"reason": 5}, format="json", HTTP_IF_MATCH='"1"')
    assert_problem(response, 400, "validation_error")
    node.refresh_from_db()
    assert (node.cordoned, node.version) == (False, 1)
