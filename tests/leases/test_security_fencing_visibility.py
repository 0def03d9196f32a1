"""Fencing validation is visible only to the lease's parties (issue 11, item 5)."""

from __future__ import annotations

import hmac

import pytest
from django.contrib.auth.models import Group, User
from rest_framework.test import APIClient

from fleet.choices import Lifecycle
from leases import fencing
from leases.models import Lease
from nodepool.api.permissions import CLIENTS, FENCING_VALIDATORS
from tests.conftest import _api
from tests.factories import PoolFactory, make_schedulable_node, set_lifecycle
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db
VALIDATE = "/api/v1/fencing/validate"


@pytest.fixture
def world(client_api):
    pool = PoolFactory(name="general")
    holder, holder_secret = make_schedulable_node(pool)
    bystander, bystander_secret = make_schedulable_node(pool)
    response = client_api.post(
        "/api/v1/node-leases", {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "1"}}, format="json"
    )
    assert response.status_code == 201, response.json()
    lease = Lease.objects.get(pk=response.json()["id"])
    other_node, other_secret = (holder, holder_secret) if lease.node_id != holder.pk else (bystander, bystander_secret)
    lease_node_secret = holder_secret if lease.node_id == holder.pk else bystander_secret
    return {"lease": lease, "node_secret": lease_node_secret, "other_node": other_node, "other_secret": other_secret}


def _user_api(name, group):
    user = User.objects.create_user(name)
    if group:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return _api(user)


def _node_api(secret):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Node {secret}")
    return api


def _validate(api, **extra):
    return api.post(VALIDATE, {"workload_id": "job-1", "fencing_token": 1, **extra}, format="json")


def test_the_leases_own_client_operators_node_and_fencing_validators_see_the_answer(world, client_api, operator_api):
    parties = [client_api, operator_api, _node_api(world["node_secret"]), _user_api("store", FENCING_VALIDATORS)]

    for api in parties:
        response = _validate(api)
        assert response.status_code == 200, response.json()
        assert response.json()["valid"] is True and response.json()["lease_id"] == str(world["lease"].pk)


def test_another_client_another_node_and_a_retired_node_get_404(world):
    retired_api = _node_api(world["other_secret"])
    set_lifecycle(world["other_node"], Lifecycle.RETIRED)

    for api in (_user_api("mallory", CLIENTS), _node_api(world["other_secret"]), retired_api):
        body = assert_problem(_validate(api), 404, "not_found")
        assert "job-1" not in str(body) and str(world["lease"].pk) not in str(body)


def test_an_unknown_workload_is_the_same_404(world, operator_api):
    assert_problem(operator_api.post(VALIDATE, {"workload_id": "nope", "fencing_token": 1}, format="json"), 404)


def test_users_with_no_role_get_403_and_anonymous_callers_401(world, anon_api):
    assert_problem(_validate(_user_api("nobody", None)), 403, "forbidden")
    assert_problem(_validate(anon_api), 401)


def test_a_caller_presenting_the_leases_own_secret_sees_it_through_the_registered_verifier(
    world, anon_api, monkeypatch
):
    def verifier(lease, secret):
        return hmac.compare_digest(secret, f"secret-of-{lease.pk}")

    monkeypatch.setattr(fencing, "LEASE_SECRET_VERIFIERS", [])
    assert_problem(_validate(anon_api, lease_secret=f"secret-of-{world['lease'].pk}"), 404)
    fencing.register_lease_secret_verifier(verifier)

    assert _validate(anon_api, lease_secret=f"secret-of-{world['lease'].pk}").json()["valid"] is True
    assert_problem(_validate(anon_api, lease_secret="guess"), 404)
    assert_problem(_validate(_user_api("mallory", CLIENTS), lease_secret="guess"), 404)
