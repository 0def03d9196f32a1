"""Junk ``page`` / ``page_size`` is a 400 on every list, not a silent default or a 404.

Before: ``?page_size=-1``, ``=0`` and ``=abc`` were ignored (the default page came back with 200),
and ``?page=abc`` / ``=0`` / ``=-1`` were 404 ``not_found`` as if the page merely did not exist.
"""

from __future__ import annotations

import pytest
from django.core.cache import cache

from tests.factories import NodeFactory
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db

LISTS = [
    "/api/v1/nodes",
    "/api/v1/pools",
    "/api/v1/bootstrap-tokens",
    "/api/v1/node-leases",
    "/api/v1/lease-requests",
    "/api/v1/shapes",
    "/api/v1/drains",
    "/api/v1/quarantines",
    "/api/v1/disruption-budgets",
    "/api/v1/lease-consistency-reports",
]


@pytest.fixture(autouse=True)
def _fresh_throttle_counts():
    cache.clear()
    yield
    cache.clear()


@pytest.mark.parametrize("path", LISTS)
@pytest.mark.parametrize("value", ["-1", "0", "abc", "1.5", "", "99999999999999999999999x"])
def test_a_malformed_page_size_is_400(operator_api, path, value):
    assert_problem(operator_api.get(f"{path}?page_size={value}"), 400, "invalid_page_size")


@pytest.mark.parametrize("path", LISTS)
@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5", ""])
def test_a_malformed_page_number_is_400(operator_api, path, value):
    assert_problem(operator_api.get(f"{path}?page={value}"), 400, "invalid_page")


def test_a_page_past_the_end_is_still_404(operator_api):
    NodeFactory()

    assert_problem(operator_api.get("/api/v1/nodes?page=2"), 404, "not_found")
    assert_problem(operator_api.get("/api/v1/nodes?page=99999999999999999999"), 404, "not_found")


def test_a_page_size_above_the_maximum_is_capped_and_good_values_work(operator_api):
    for _ in range(3):
        NodeFactory()

    assert len(operator_api.get("/api/v1/nodes?page_size=10000000000000000000000").json()["results"]) == 3
    body = operator_api.get("/api/v1/nodes?page_size=2&page=2").json()
    assert (body["count"], len(body["results"])) == (3, 1)
    assert operator_api.get("/api/v1/nodes?page=last&page_size=2").status_code == 200
