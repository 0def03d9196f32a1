"""ETag / If-Match / expected_version: optimistic concurrency for operator actions."""

from __future__ import annotations

import json
import re

import pytest
from django.db import transaction
from django.db.transaction import TransactionManagementError

from fleet.models import Pool
from nodepool.api.problems import NotFound, PreconditionFailed
from nodepool.api.versioning import etag_for, lock_for_action
from tests.conftest import _api
from tests.factories import PoolFactory
from tests.problems import assert_problem
from tests.races import Hold, race

pytestmark = pytest.mark.urls("tests.plumbing_urls")


def describe(api, pool, body=None, **headers):
    path = f"/plumbing/pools/{pool.pk}/describe"
    return api.generic("POST", path, json.dumps(body or {}), content_type="application/json", **headers)


@pytest.mark.django_db
def test_get_carries_the_version_as_a_strong_etag(operator_api):
    pool = PoolFactory()
    response = operator_api.get(f"/plumbing/pools/{pool.pk}")
    assert response.status_code == 200
    assert response.json()["version"] == 1
    assert response["ETag"] == etag_for(1, response.json())
    assert re.fullmatch(r'"1\.[0-9a-f]{12}"', response["ETag"])


@pytest.mark.django_db
def test_if_match_with_the_current_etag_acts_and_bumps_the_version(operator_api):
    pool = PoolFactory()
    etag = operator_api.get(f"/plumbing/pools/{pool.pk}")["ETag"]

    response = describe(operator_api, pool, {"description": "racked"}, HTTP_IF_MATCH=etag)

    assert response.status_code == 200
    assert response["ETag"] == etag_for(2, response.json())
    pool.refresh_from_db()
    assert (pool.version, pool.description) == (2, "racked")


@pytest.mark.django_db
def test_a_weak_etag_never_matches_if_match_strong_comparison(operator_api):
    pool = PoolFactory()
    assert_problem(describe(operator_api, pool, HTTP_IF_MATCH='W/"1"'), 412, "version_mismatch")


@pytest.mark.django_db
def test_an_unquoted_version_number_in_if_match_is_400(operator_api):
    pool = PoolFactory()
    assert_problem(describe(operator_api, pool, HTTP_IF_MATCH="1"), 400, "invalid_if_match")


@pytest.mark.django_db
def test_stale_if_match_is_412_and_changes_nothing(operator_api):
    pool = PoolFactory()
    assert describe(operator_api, pool, {"description": "first"}, HTTP_IF_MATCH='"1"').status_code == 200

    response = describe(operator_api, pool, {"description": "second"}, HTTP_IF_MATCH='"1"')

    body = assert_problem(response, 412, "version_mismatch")
    assert body["current_version"] == 2
    pool.refresh_from_db()
    assert (pool.version, pool.description) == (2, "first")


@pytest.mark.django_db
def test_missing_version_is_428_and_changes_nothing(operator_api):
    pool = PoolFactory()
    assert_problem(describe(operator_api, pool, {"description": "x"}), 428, "version_required")
    pool.refresh_from_db()
    assert pool.version == 1


@pytest.mark.django_db
@pytest.mark.parametrize("header", ["1, 2", "abc", '"1', "", '"1" "2"', "W/1", '"1",x'])
def test_malformed_if_match_is_400(operator_api, header):
    pool = PoolFactory()
    assert_problem(describe(operator_api, pool, HTTP_IF_MATCH=header), 400, "invalid_if_match")
    pool.refresh_from_db()
    assert pool.version == 1


@pytest.mark.django_db
@pytest.mark.parametrize("header", ['"-1"', '"99999999999999999999999"', '"xyzzy"', 'W/"1", W/"2"'])
def test_well_formed_tags_that_are_not_the_current_version_are_412(operator_api, header):
    pool = PoolFactory()
    assert_problem(describe(operator_api, pool, HTTP_IF_MATCH=header), 412, "version_mismatch")
    pool.refresh_from_db()
    assert pool.version == 1


@pytest.mark.django_db
def test_if_match_star_on_an_operator_action_is_428(operator_api):
    pool = PoolFactory()
    assert_problem(describe(operator_api, pool, HTTP_IF_MATCH="*"), 428, "version_required")


@pytest.mark.django_db
@pytest.mark.parametrize("header", ['"7", "1"', '"xyzzy", "r2d2xxxx", "1"', 'W/"1", "1"', ' , "1" ,'])
def test_a_list_matches_when_any_strong_member_does(operator_api, header):
    pool = PoolFactory()
    assert describe(operator_api, pool, HTTP_IF_MATCH=header).status_code == 200


@pytest.mark.django_db
def test_expected_version_in_the_body_works_like_if_match(operator_api):
    pool = PoolFactory()
    assert describe(operator_api, pool, {"expected_version": 1, "description": "a"}).status_code == 200
    assert_problem(describe(operator_api, pool, {"expected_version": 1, "description": "b"}), 412, "version_mismatch")
    pool.refresh_from_db()
    assert (pool.version, pool.description) == (2, "a")


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["1", 1.5, True, -1, [1], {"v": 1}])
def test_malformed_expected_version_is_400(operator_api, value):
    pool = PoolFactory()
    assert_problem(describe(operator_api, pool, {"expected_version": value}), 400, "invalid_version")


@pytest.mark.django_db
def test_a_version_check_on_a_missing_object_is_404(operator_api):
    response = operator_api.generic(
        "POST", "/plumbing/pools/424242/describe", "{}", content_type="application/json", HTTP_IF_MATCH='"1"'
    )
    assert_problem(response, 404, "not_found")


@pytest.mark.django_db(transaction=True)
def test_lock_for_action_refuses_to_run_outside_a_transaction():
    pool = PoolFactory()
    with pytest.raises(TransactionManagementError):
        lock_for_action(Pool.objects, pk=pool.pk, expected=1)


@pytest.mark.django_db
def test_lock_for_action_returns_the_row_or_raises_404_and_412():
    pool = PoolFactory()
    with transaction.atomic():
        assert lock_for_action(Pool.objects, pk=pool.pk, expected=1) == pool
        with pytest.raises(PreconditionFailed):
            lock_for_action(Pool.objects, pk=pool.pk, expected=7)
        with pytest.raises(NotFound):
            lock_for_action(Pool.objects, pk=pool.pk + 1000, expected=1)


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("racers", [2, 6])
def test_of_several_actions_on_the_same_version_exactly_one_wins(operator, racers):
    pool = PoolFactory()

    def act(n: int) -> int:
        body = {"expected_version": 1, "description": f"racer-{n}"}
        return describe(_api(operator), pool, body).status_code

    # Every racer that reads the row waits there for the others: without the row lock they would
    # all read version 1 and all pass the check.
    with Hold("nodepool.api.versioning.check_version", parties=racers, timeout=0.3) as hold:
        statuses = race(act, racers).results

    assert hold.max_inside == 1, "the version check ran under the row lock, one racer at a time"
    assert sorted(statuses) == [200] + [412] * (racers - 1)
    pool.refresh_from_db()
    assert pool.version == 2
    assert pool.description.startswith("racer-")
