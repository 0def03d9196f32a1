"""Clients see what they need (issue 30, item 5): a lease client reading a marketplace node sees
neither its owner nor its enrollment details (the bootstrap token's prefix); operators and the
node's owner do."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.models import BootstrapToken, Node
from tests.factories import PoolFactory
from tests.marketplace_support import owned_node

pytestmark = pytest.mark.django_db


@pytest.fixture
def contributed(owner):
    node, _ = owned_node(PoolFactory(name="market"), owner, "m1")
    token = BootstrapToken.objects.create(
        pool=node.pool, prefix="abcd1234", secret_hash="x", max_uses=1, expires_at=timezone.now() + timedelta(days=1)
    )
    Node.objects.filter(pk=node.pk).update(bootstrap_token=token)
    return node


def test_a_lease_client_sees_neither_the_owner_nor_the_enrollment_of_a_node(client_api, contributed):
    for body in (
        client_api.get(f"/api/v1/nodes/{contributed.pk}").json(),
        client_api.get("/api/v1/nodes").json()["results"][0],
    ):
        assert body["owner"] is None
        assert body["enrollment"] == {}
        assert "abcd1234" not in str(body) and "oscar-owner" not in str(body)
        assert body["schedulable"] is True and body["capacity"]  # what placement needs is still there


@pytest.mark.parametrize("reader", ["operator_api", "owner_api"])
def test_operators_and_the_owner_see_both(reader, request, contributed):
    body = request.getfixturevalue(reader).get(f"/api/v1/nodes/{contributed.pk}").json()
    assert body["owner"] == "oscar-owner"
    assert body["enrollment"]["bootstrap_token"] == "abcd1234"
