"""A pool's re-verification schedule: what is accepted and what is refused (issue 32, "Bad input")."""

import pytest

from fleet.models import Pool
from tests.fleet_support import make_pool

pytestmark = pytest.mark.django_db
POOLS = "/api/v1/pools"
DAY = 86400


def test_operator_sets_a_schedule_and_reads_it_back(operator_api):
    body = {
        "name": "rack4",
        "reverification_period": DAY,
        "reverification_window": 6 * 3600,
        "reverification_tolerance_percent": 15,
        "reverification_busy_policy": "idle",
    }
    response = operator_api.post(POOLS, body, format="json")
    assert response.status_code == 201, response.json()
    data = response.json()
    assert (data["reverification_period"], data["reverification_window"]) == (DAY, 6 * 3600)
    assert (data["reverification_tolerance_percent"], data["reverification_busy_policy"]) == (15.0, "idle")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"reverification_period": 3600, "reverification_window": 7200}, "reverification_window"),
        ({"reverification_period": 59}, "reverification_period"),
        ({"reverification_period": 30 * DAY + 1}, "reverification_period"),
        ({"reverification_period": DAY, "reverification_window": 30}, "reverification_window"),
        ({"reverification_tolerance_percent": 100.5}, "reverification_tolerance_percent"),
        ({"reverification_tolerance_percent": -1}, "reverification_tolerance_percent"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_field_and_stores_nothing(operator_api, body, field):
    response = operator_api.post(POOLS, {"name": "p", **body}, format="json")
    assert response.status_code == 400, response.json()
    problem = response.json()
    assert response["Content-Type"].startswith("application/problem+json")
    assert problem["code"] == "invalid_pool_policy"
    assert [e["field"] for e in problem["errors"]] == [field]
    assert Pool.objects.count() == 0


@pytest.mark.parametrize(
    "body",
    [
        {"reverification_period": "daily"},
        {"reverification_window": -5},
        {"reverification_busy_policy": "whenever"},
        {"reverification_tolerance_percent": "lots"},
    ],
)
def test_a_malformed_schedule_is_a_validation_error(operator_api, body):
    response = operator_api.post(POOLS, {"name": "p", **body}, format="json")
    assert response.status_code == 400, response.json()
    assert response.json()["code"] == "validation_error"
    assert list(response.json()["errors"][0]["field"].split("."))[0] in body
    assert Pool.objects.count() == 0


def test_a_patch_that_breaks_the_schedule_changes_nothing(operator_api):
    make_pool(name="general", reverification_period=DAY, reverification_window=3600)
    response = operator_api.patch(
        f"{POOLS}/general", {"reverification_window": 2 * DAY}, format="json", HTTP_IF_MATCH='"1"'
    )
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "reverification_window"
    pool = Pool.objects.get()
    assert (pool.reverification_window, pool.version) == (3600, 1)


def test_a_window_equal_to_the_period_and_the_bounds_are_accepted(operator_api):
    for name, period, window in (("a", 60, 60), ("b", 30 * DAY, 30 * DAY), ("c", DAY, 60)):
        body = {"name": name, "reverification_period": period, "reverification_window": window}
        body["reverification_tolerance_percent"] = 0 if name == "a" else 100
        assert operator_api.post(POOLS, body, format="json").status_code == 201
