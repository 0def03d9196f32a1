"""List filters of bootstrap tokens, upgrades, scale decisions and pool prices (docs/api-contract.md,
"Query parameters"): a known filter narrows; an unknown parameter, a bad value or an empty value is
``400 invalid_filter`` naming the parameter, never the whole collection."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from fleet.models import BootstrapToken
from marketplace.pricing import set_price
from operations.models import ScaleDecision, Upgrade
from tests.factories import PoolFactory
from tests.fleet_support import make_token
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db
API = "/api/v1"


def _ids(response) -> set[str]:
    assert response.status_code == 200, response.content[:500]
    return {str(item["id"]) for item in response.json()["results"]}


@pytest.fixture
def tokens():
    """One bootstrap token in each state, in pool ``general`` except the active one of ``gpu``."""
    general, gpu = PoolFactory(name="general"), PoolFactory(name="gpu")
    for pool in (gpu, general, general, general):
        make_token(pool, max_uses=2)
    active, exhausted, expired, revoked = BootstrapToken.objects.order_by("pk")
    BootstrapToken.objects.filter(pk=exhausted.pk).update(uses=2)
    BootstrapToken.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    BootstrapToken.objects.filter(pk=revoked.pk).update(revoked_at=timezone.now())
    return {"active": active, "exhausted": exhausted, "expired": expired, "revoked": revoked}


def test_bootstrap_tokens_filter_by_pool_and_state(operator_api, tokens):
    ids = {state: str(token.pk) for state, token in tokens.items()}
    assert _ids(operator_api.get(f"{API}/bootstrap-tokens?pool=gpu")) == {ids["active"]}
    assert _ids(operator_api.get(f"{API}/bootstrap-tokens?pool=nowhere")) == set()
    for state, token_id in ids.items():
        response = operator_api.get(f"{API}/bootstrap-tokens?state={state}")
        assert _ids(response) == {token_id}, state
        assert [item["state"] for item in response.json()["results"]] == [state]
    both = operator_api.get(f"{API}/bootstrap-tokens?state=expired&state=revoked&pool=general")
    assert _ids(both) == {ids["expired"], ids["revoked"]}
    assert len(_ids(operator_api.get(f"{API}/bootstrap-tokens?page_size=2&page=1"))) == 2


def _refused(api, url: str, field: str) -> dict:
    body = assert_problem(api.get(url), 400, "invalid_filter")
    assert body["field"] == field, body
    # nodepool.api.filters refuses an empty value with the field alone; the filter sets add errors.
    assert body.get("errors", [{"field": field}])[0]["field"] == field, body
    return body


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("state=bogus", "state"),
        ("state=active&state=bogus", "state"),
        ("state=", "state"),
        ("pool=", "pool"),
        ("foo=bar", "foo"),
        ("pool__name=gpu", "pool__name"),
    ],
)
def test_bootstrap_tokens_refuse_unknown_bad_and_empty_filters(operator_api, tokens, query, field):
    _refused(operator_api, f"{API}/bootstrap-tokens?{query}", field)


def test_a_bad_choice_names_the_choices(operator_api, tokens):
    body = _refused(operator_api, f"{API}/bootstrap-tokens?state=bogus", "state")
    assert "active, exhausted, expired, revoked" in body["errors"][0]["message"]
    assert body["errors"][0]["code"] == "invalid_choice"
    unknown = _refused(operator_api, f"{API}/bootstrap-tokens?foo=bar", "foo")
    assert "pool, state" in unknown["detail"]


@pytest.fixture
def upgrades():
    general, gpu = PoolFactory(name="general"), PoolFactory(name="gpu")
    first = Upgrade.objects.create(pool=general, target={"version": "2.0.0"})
    second = Upgrade.objects.create(pool=gpu, target={"version": "2.0.0"}, state="completed")
    return first, second


def test_upgrades_filter_by_pool_and_state(operator_api, upgrades):
    first, second = (str(u.pk) for u in upgrades)
    assert _ids(operator_api.get(f"{API}/upgrades?pool=gpu")) == {second}
    assert _ids(operator_api.get(f"{API}/upgrades?state=pending")) == {first}
    assert _ids(operator_api.get(f"{API}/upgrades?state=pending&state=completed")) == {first, second}
    assert _ids(operator_api.get(f"{API}/upgrades?pool=general&state=completed")) == set()
    assert operator_api.get(f"{API}/upgrades/{first}").status_code == 200


@pytest.mark.parametrize(
    ("query", "field"), [("state=bogus", "state"), ("state=", "state"), ("pool=", "pool"), ("foo=bar", "foo")]
)
def test_upgrades_refuse_unknown_bad_and_empty_filters(operator_api, upgrades, query, field):
    _refused(operator_api, f"{API}/upgrades?{query}", field)


@pytest.fixture
def decisions():
    general, gpu = PoolFactory(name="general"), PoolFactory(name="gpu")
    up = ScaleDecision.objects.create(pool=general, direction="up", outcome="requested", count=1, reason="r")
    down = ScaleDecision.objects.create(pool=gpu, direction="down", outcome="blocked", count=1, reason="r")
    return up, down


def test_scale_decisions_filter_by_pool(operator_api, decisions):
    up, down = (str(d.pk) for d in decisions)
    assert _ids(operator_api.get(f"{API}/scale-decisions?pool=gpu")) == {down}
    assert _ids(operator_api.get(f"{API}/scale-decisions")) == {up, down}
    assert _ids(operator_api.get(f"{API}/scale-decisions?pool=nowhere")) == set()


@pytest.mark.parametrize(("query", "field"), [("pool=", "pool"), ("foo=bar", "foo"), ("state=ready", "state")])
def test_scale_decisions_refuse_unknown_and_empty_filters(operator_api, decisions, query, field):
    _refused(operator_api, f"{API}/scale-decisions?{query}", field)


@pytest.fixture
def prices():
    general, gpu = PoolFactory(name="general"), PoolFactory(name="gpu")
    since = timezone.now() - timedelta(days=1)
    for pool in (general, gpu):
        set_price(pool=pool, resource="cpu", unit_price=Decimal("0.5"), currency="EUR", effective_from=since)
    return general, gpu


def test_pool_prices_filter_by_pool(operator_api, client_api, prices):
    for api in (operator_api, client_api):
        assert [p["pool"] for p in api.get(f"{API}/pool-prices?pool=gpu").json()["results"]] == ["gpu"]
        assert api.get(f"{API}/pool-prices").json()["count"] == 2
        assert api.get(f"{API}/pool-prices?pool=nowhere").json()["count"] == 0


@pytest.mark.parametrize(("query", "field"), [("pool=", "pool"), ("foo=bar", "foo"), ("resource=cpu", "resource")])
def test_pool_prices_refuse_unknown_and_empty_filters(operator_api, prices, query, field):
    _refused(operator_api, f"{API}/pool-prices?{query}", field)
