from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.choices import PoolKind
from fleet.models import BootstrapToken, Node
from fleet.secrets import hash_secret
from fleet.services import node_enroll
from nodepool.api.problems import Forbidden
from tests.fleet_support import enroll, fresh_throttles, make_pool, make_token  # noqa: F401
from tests.races import race

pytestmark = pytest.mark.usefixtures("fresh_throttles")
TOKENS = "/api/v1/bootstrap-tokens"


@pytest.mark.django_db
def test_operator_creates_a_token_and_sees_the_secret_once(operator_api, operator):
    make_pool(name="general")
    response = operator_api.post(TOKENS, {"pool": "general", "max_uses": 3, "ttl_seconds": 600}, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    secret = body["token"]
    assert secret.startswith("npb_")
    token = BootstrapToken.objects.get()
    assert token.secret_hash == hash_secret(secret)
    assert token.created_by == operator and token.max_uses == 3
    listing = operator_api.get(TOKENS).json()
    assert listing["count"] == 1
    assert "token" not in listing["results"][0]
    assert secret not in str(operator_api.get(f"{TOKENS}/{token.pk}").json())
    assert listing["results"][0]["state"] == "active"


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, code",
    [
        ({"pool": "nope"}, "validation_error"),
        ({"pool": "general", "max_uses": 0}, "validation_error"),
        ({"pool": "general", "ttl_seconds": 5}, "validation_error"),
        ({"pool": "general", "expires_at": "2000-01-01T00:00:00Z"}, "invalid_expiry"),
        ({"pool": "general", "expires_at": "yesterday"}, "validation_error"),
        ({"pool": "general", "ttl_seconds": 600, "expires_at": "2099-01-01T00:00:00Z"}, "validation_error"),
        ({"pool": "general", "uses": 0}, "unknown_field"),
        ({"pool": "market"}, "owner_required"),
        ({"pool": "general", "owner": "nobody"}, "validation_error"),
    ],
)
def test_bad_token_requests_are_refused(operator_api, body, code):
    make_pool(name="general")
    make_pool(name="market", kind=PoolKind.MARKETPLACE)
    response = operator_api.post(TOKENS, body, format="json")
    assert response.status_code == 400, response.json()
    assert response.json()["code"] == code
    assert BootstrapToken.objects.count() == 0


@pytest.mark.django_db
def test_only_operators_manage_tokens(client_api, owner_api, anon_api):
    make_pool(name="general")
    for api in (client_api, owner_api):
        assert api.post(TOKENS, {"pool": "general"}, format="json").status_code == 403
        assert api.get(TOKENS).status_code == 403
    assert anon_api.get(TOKENS).status_code == 401
    assert BootstrapToken.objects.count() == 0


@pytest.mark.django_db
def test_revoking_an_unknown_token_is_404(operator_api):
    response = operator_api.post(f"{TOKENS}/999/revoke")
    assert response.status_code == 404


@pytest.mark.django_db
def test_revoking_twice_keeps_the_first_time(operator_api, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    make_token(make_pool())
    token = BootstrapToken.objects.get()
    first = operator_api.post(f"{TOKENS}/{token.pk}/revoke").json()["revoked_at"]
    time_machine.shift(60)
    assert operator_api.post(f"{TOKENS}/{token.pk}/revoke").json()["revoked_at"] == first


def _race_for_last_use(secret: str, threads: int) -> list[str]:
    def attempt(index: int) -> str:
        try:
            node_enroll(
                bootstrap_token=secret,
                hostname=f"racer-{index}",
                agent_version="1.0.0",
                capability={"resources": {"cpu": 1000, "memory": 2**30}},
            )
            return "won"
        except Forbidden as exc:
            return exc.get_codes()

    outcome = race(attempt, threads)
    assert not outcome.errors, outcome.errors
    return outcome.results


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_racing_enrollments_for_the_last_use_have_exactly_one_winner():
    pool = make_pool()
    secret = make_token(pool, max_uses=3)
    BootstrapToken.objects.update(uses=2)

    outcomes = _race_for_last_use(secret, threads=8)

    assert outcomes.count("won") == 1, outcomes
    assert outcomes.count("bootstrap_token_exhausted") == 7
    assert Node.objects.count() == 1
    assert BootstrapToken.objects.get().uses == 3


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_racing_enrollments_never_exceed_max_uses():
    pool = make_pool()
    secret = make_token(pool, max_uses=4)

    outcomes = _race_for_last_use(secret, threads=10)

    assert outcomes.count("won") == 4, outcomes
    assert Node.objects.count() == 4
    assert BootstrapToken.objects.get().uses == 4


@pytest.mark.django_db
def test_token_state_reads_expired_and_exhausted(operator_api):
    pool = make_pool()
    make_token(pool, max_uses=1)
    BootstrapToken.objects.update(uses=1)
    assert operator_api.get(TOKENS).json()["results"][0]["state"] == "exhausted"
    BootstrapToken.objects.update(uses=0, expires_at=timezone.now() - timedelta(seconds=1))
    assert operator_api.get(TOKENS).json()["results"][0]["state"] == "expired"


@pytest.mark.django_db
def test_unknown_token_detail_is_404(operator_api):
    assert operator_api.get(f"{TOKENS}/999").status_code == 404
    assert operator_api.get(f"{TOKENS}/abc").status_code == 404
