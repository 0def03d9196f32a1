"""Workload ids are one namespace across clients: another client's live lease is never named.

``POST /node-leases`` (direct and queued) answers 409 ``workload_has_live_lease`` to everyone, but
only the lease's own client and operators are told its id; ``/fencing/validate`` never names a live
lease the caller may not see.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User

from fleet.models import NodeResource
from leases.choices import LeaseState
from leases.models import Lease, LeaseRequest
from nodepool.api.permissions import CLIENTS
from tests.conftest import _api
from tests.factories import PoolFactory, make_schedulable_node
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db


@pytest.fixture
def pool():
    return PoolFactory(name="general")


@pytest.fixture
def client2_api():
    user = User.objects.create_user("cedric-client2")
    user.groups.add(Group.objects.get_or_create(name=CLIENTS)[0])
    return _api(user)


def ask(api, **body):
    body = {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "1"}, **body}
    return api.post("/api/v1/node-leases", body, format="json")


@pytest.fixture
def client1_lease(client_api, pool):
    make_schedulable_node(pool)
    response = ask(client_api)
    assert response.status_code == 201, response.json()
    return Lease.objects.get(pk=response.json()["id"])


def _names_no_lease(body, lease):
    assert "lease_id" not in body
    assert str(lease.pk) not in str(body)


def test_another_client_is_told_the_workload_id_is_in_use_without_the_lease(client1_lease, client2_api):
    body = assert_problem(ask(client2_api), 409, "workload_has_live_lease")
    _names_no_lease(body, client1_lease)
    assert "in use" in body["detail"]


def test_another_client_queueing_is_refused_without_the_lease(client1_lease, client2_api):
    # Nothing fits now, so the request would be queued (202): the live-lease check comes first.
    NodeResource.objects.filter(name="cpu").update(allocated=4000)
    body = assert_problem(ask(client2_api, queue=True), 409, "workload_has_live_lease")
    _names_no_lease(body, client1_lease)
    assert not LeaseRequest.objects.exists()


def test_another_client_losing_the_race_on_the_unique_index_is_not_told_the_lease(client1_lease, client2_api):
    # A node fits: the partial unique index refuses the grant (IntegrityError path).
    make_schedulable_node(client1_lease.pool)
    body = assert_problem(ask(client2_api), 409, "workload_has_live_lease")
    _names_no_lease(body, client1_lease)


@pytest.mark.parametrize("queue", [False, True])
def test_the_leases_own_client_and_operators_are_told_the_lease(client1_lease, client_api, operator_api, queue):
    if queue:
        NodeResource.objects.filter(name="cpu").update(allocated=4000)
    for api in (client_api, operator_api):
        body = assert_problem(ask(api, queue=queue), 409, "workload_has_live_lease")
        assert body["lease_id"] == str(client1_lease.pk)
        assert str(client1_lease.pk) in body["detail"]


def test_fencing_validate_never_names_a_live_lease_the_caller_may_not_see(client1_lease, client2_api):
    # client2 holds the workload's latest (ended) lease; client1's older lease is the live one.
    client2 = User.objects.get(username="cedric-client2")
    Lease.objects.filter(pk=client1_lease.pk).update(fencing_token=1)
    ours = Lease.objects.get(pk=client1_lease.pk)
    # A copy of the row (the state is protected: it is set once, at creation).
    values = {f.attname: getattr(ours, f.attname) for f in Lease._meta.concrete_fields if not f.primary_key}
    values.update(client_id=client2.pk, fencing_token=2, state=LeaseState.RELEASED, idempotency_key="other")
    Lease.objects.create(**values)
    response = client2_api.post("/api/v1/fencing/validate", {"workload_id": "job-1", "fencing_token": 2}, format="json")
    body = assert_problem(response, 404)
    assert str(client1_lease.pk) not in str(body)
