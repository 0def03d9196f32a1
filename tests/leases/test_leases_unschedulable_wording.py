"""The 409 unschedulable explanation speaks of the request, not of a Kubernetes Pod."""

from __future__ import annotations

import pytest

from tests.factories import PoolFactory, make_schedulable_node

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("constraint", "phrase"),
    [
        ({"node_selector": {"zone": "nowhere"}}, "1 node(s) didn't match the request's node selector"),
        (
            {"affinity": {"required": [{"key": "arch", "operator": "In", "values": ["s390x"]}]}},
            "1 node(s) didn't match the request's node affinity",
        ),
    ],
    ids=["node_selector", "affinity"],
)
def test_an_unmatched_selector_or_affinity_is_explained_without_pods(client_api, constraint, phrase):
    make_schedulable_node(PoolFactory(name="general"))
    body = {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "100m"}, **constraint}
    response = client_api.post("/api/v1/node-leases", body, format="json")
    assert response.status_code == 409
    assert response.json()["code"] == "unschedulable"
    assert phrase in response.json()["detail"]
    assert "Pod" not in response.json()["detail"]
