"""Per-lease secrets: derived (HMAC), delivered in the heartbeat answer, verified and rejected
through the fencing validation."""

from __future__ import annotations

import pytest
import time_machine

from leases import secrets
from leases.fencing import lease_release, lease_renew
from tests.heartbeat_support import beat, node_api
from tests.marketplace_support import ACTOR, at, grant_at, owned_node, priced_pool

pytestmark = pytest.mark.django_db
API = "/api/v1"


@pytest.fixture
def setup(owner, client_user):
    pool = priced_pool()
    node, credential = owned_node(pool, owner, "s")
    lease = grant_at(0, client_user, pool, "job-secret", node=node, ttl=600)
    return node, credential, lease


def heartbeat_secret(node, credential, lease, sequence=1):
    listed = [{"lease_id": str(lease.pk), "fencing_token": lease.fencing_token, "state": "running"}]
    answer = node_api(credential).post(
        f"{API}/nodes/{node.pk}/heartbeats", beat(sequence, leases=listed), format="json"
    )
    assert answer.status_code == 200, answer.content
    [entry] = answer.json()["leases"]
    return entry


def test_the_heartbeat_answer_carries_the_lease_secret_which_verifies(setup):
    node, credential, lease = setup
    with time_machine.travel(at(10), tick=False):
        entry = heartbeat_secret(node, credential, lease)
        assert entry["lease_secret"].startswith(f"npls.{lease.pk}.{lease.fencing_token}.")
        assert entry["lease_secret_expires_at"] == lease.expires_at.replace(microsecond=0).isoformat()
        check = secrets.verify_lease_secret(entry["lease_secret"])
    assert (check.valid, check.code, check.lease_id, check.workload_id) == (True, "valid", str(lease.pk), "job-secret")


def test_the_secret_is_derived_not_stored(setup):
    _, _, lease = setup
    first = secrets.secret_for(lease)
    assert first == secrets.secret_for(lease)
    from django.db import connection

    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            if table.startswith(("leases_", "fleet_", "marketplace_")):
                cursor.execute(f'SELECT * FROM "{table}"')
                assert first.split(".")[-1] not in str(cursor.fetchall())


def test_a_released_lease_rejects_its_secret_as_stale(setup, client_user):
    _, _, lease = setup
    secret = secrets.secret_for(lease)
    with time_machine.travel(at(20), tick=False):
        lease_release(
            lease_id=lease.pk,
            data={"fencing_token": lease.fencing_token, "node_incarnation": 1},
            user=client_user,
            actor=ACTOR,
        )
        check = secrets.verify_lease_secret(secret)
    assert (check.valid, check.code) == (False, "stale_lease_secret")


def test_an_expired_secret_is_rejected_and_a_renewal_gives_a_new_one(setup, client_user):
    _, _, lease = setup
    old = secrets.secret_for(lease)
    with time_machine.travel(at(300), tick=False):
        renewed = lease_renew(
            lease_id=lease.pk,
            data={"fencing_token": lease.fencing_token, "node_incarnation": 1, "ttl_seconds": 600},
            user=client_user,
            actor=ACTOR,
        )
        new = secrets.secret_for(renewed)
        assert new != old
        assert secrets.verify_lease_secret(old).valid and secrets.verify_lease_secret(new).valid
    with time_machine.travel(at(700), tick=False):
        assert secrets.verify_lease_secret(old).code == "lease_secret_expired"
        assert secrets.verify_lease_secret(new).valid


@pytest.mark.parametrize(
    "mangle, code",
    [
        (lambda s: s[:-4] + "AAAA", "bad_lease_secret"),
        (lambda s: s.replace(".", ":"), "malformed_lease_secret"),
        (lambda s: "npls.not-a-uuid.1.2.mac", "malformed_lease_secret"),
        (lambda s: "npls.00000000-0000-0000-0000-000000000000.1.9999999999.mac", "bad_lease_secret"),
        (lambda s: s + "x" * 300, "malformed_lease_secret"),
        (lambda s: 12345, "malformed_lease_secret"),
    ],
)
def test_forged_or_malformed_secrets_are_rejected(setup, mangle, code):
    _, _, lease = setup
    check = secrets.verify_lease_secret(mangle(secrets.secret_for(lease)))
    assert (check.valid, check.code) == (False, code)


def test_a_different_server_key_rejects_the_secret(setup, settings):
    _, _, lease = setup
    secret = secrets.secret_for(lease)
    settings.NODEPOOL = {**settings.NODEPOOL, "LEASE_SECRET_KEY": "another key"}
    assert secrets.verify_lease_secret(secret).code == "bad_lease_secret"


def test_the_fencing_validation_endpoint_checks_a_lease_secret(setup, client_api):
    _, _, lease = setup
    with time_machine.travel(at(10), tick=False):
        answer = client_api.post(f"{API}/fencing/validate", {"lease_secret": secrets.secret_for(lease)}, format="json")
    assert answer.status_code == 200
    assert (answer.json()["valid"], answer.json()["lease_id"]) == (True, str(lease.pk))
    refused = client_api.post(f"{API}/fencing/validate", {"lease_secret": "npls.junk"}, format="json").json()
    assert (refused["valid"], refused["code"]) == (False, "malformed_lease_secret")
