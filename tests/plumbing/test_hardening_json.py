"""The shared JSON parser refuses what the database cannot store, for every endpoint, with a 400.

Python's ``json`` reads ``NaN``/``Infinity``, integers of any size, ``\\u0000``, lone surrogates
and duplicate keys. None of them can be stored faithfully (PostgreSQL's jsonb refuses NaN and
``\\u0000``, text columns refuse NUL, no column holds an integer beyond 64 bits, a lone surrogate
cannot be encoded as UTF-8) and the answers were a 409 ``integrity_error`` (SQLite's JSON check),
a 400 ``value_out_of_range`` or a 500 depending on the field and the database.
"""

from __future__ import annotations

import pytest
from django.core.cache import cache

from fleet.choices import Lifecycle
from fleet.models import Node, Pool
from maintenance.models import Quarantine
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node, set_lifecycle
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_throttle_counts():
    cache.clear()
    yield
    cache.clear()


def post_raw(api, path: str, raw: str, **headers):
    return api.generic("POST", path, raw.encode("utf-8", "surrogatepass"), content_type="application/json", **headers)


BAD_DOCUMENTS = [
    pytest.param('{"reason": "x", "evidence": {"load": NaN}}', "non_finite_number", id="nan"),
    pytest.param('{"reason": "x", "evidence": {"load": Infinity}}', "non_finite_number", id="infinity"),
    pytest.param('{"reason": "x", "evidence": {"load": -Infinity}}', "non_finite_number", id="minus-infinity"),
    pytest.param('{"reason": "x", "evidence": {"load": 1e999}}', "non_finite_number", id="float-overflow"),
    pytest.param('{"reason": "x", "evidence": {"load": 9223372036854775808}}', "number_out_of_range", id="int-2^63"),
    pytest.param('{"reason": "x", "evidence": {"load": -9223372036854775809}}', "number_out_of_range", id="int-neg"),
    pytest.param('{"reason": "x", "evidence": {"note": "a\\u0000b"}}', "nul_character", id="nul-in-value"),
    pytest.param('{"reason": "x", "evidence": {"a\\u0000": 1}}', "nul_character", id="nul-in-key"),
    pytest.param('{"reason": "x\\u0000"}', "nul_character", id="nul-in-text-field"),
    pytest.param('{"reason": "x", "evidence": {"note": "\\ud800"}}', "invalid_unicode", id="lone-surrogate"),
    pytest.param('{"reason": "x", "evidence": {}, "evidence": {"a": 1}}', "duplicate_key", id="duplicate-key"),
]


@pytest.mark.parametrize(("raw", "code"), BAD_DOCUMENTS)
def test_a_quarantine_with_unstorable_json_is_refused_with_400_and_nothing_changes(operator_api, raw, code):
    node = set_lifecycle(NodeFactory(), Lifecycle.READY)

    response = post_raw(operator_api, f"/api/v1/nodes/{node.pk}/quarantine", raw, HTTP_IF_MATCH=f'"{node.version}"')

    assert_problem(response, 400, code)
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.READY
    assert not Quarantine.objects.exists()


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        pytest.param('{"name": "p1", "labels": {"zone": "a"}, "benchmark_tolerance": NaN}', "non_finite_number"),
        pytest.param('{"name": "p1", "benchmark_timeout": 99999999999999999999999}', "number_out_of_range"),
        pytest.param('{"name": "p1", "description": "\\u0000"}', "nul_character"),
        pytest.param('{"name": "p1", "name": "p2"}', "duplicate_key"),
    ],
)
def test_creating_a_pool_with_unstorable_json_is_refused_with_400(operator_api, raw, code):
    response = post_raw(operator_api, "/api/v1/pools", raw)

    assert_problem(response, 400, code)
    assert not Pool.objects.exists()


def test_an_enrollment_with_nan_in_its_capability_is_refused_before_the_token_is_used(anon_api):
    raw = '{"bootstrap_token": "npb_x.y", "hostname": "h1", "capability": {"resources": {"cpu": NaN}}}'

    response = post_raw(anon_api, "/api/v1/node-enrollments", raw)

    assert_problem(response, 400, "non_finite_number")
    assert not Node.objects.exists()


def test_a_heartbeat_with_infinity_is_refused_with_400_and_not_applied(anon_api):
    node, secret = make_schedulable_node()
    before = node.last_heartbeat_at
    raw = '{"incarnation": %d, "sequence": 1, "observed_at": "2026-11-29T09:00:00Z", "usage": {"cpu": Infinity}}'

    response = post_raw(
        anon_api, f"/api/v1/nodes/{node.pk}/heartbeats", raw % node.incarnation, HTTP_AUTHORIZATION=f"Node {secret}"
    )

    assert_problem(response, 400, "non_finite_number")
    node.refresh_from_db()
    assert node.last_heartbeat_at == before


def test_large_but_storable_numbers_and_ordinary_unicode_still_parse(operator_api):
    raw = '{"name": "p1", "description": "caf\\u00e9 \\ud83d\\ude80 \\u4e2d", "labels": {"big": "9223372036854775807"}}'

    response = post_raw(operator_api, "/api/v1/pools", raw)

    assert response.status_code == 201, response.content
    assert Pool.objects.get(name="p1").description == "café 🚀 中"


@pytest.mark.urls("tests.plumbing_urls")
def test_a_64_bit_number_a_32_bit_column_cannot_hold_is_still_400_value_out_of_range(operator_api):
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("SQLite integers are 64-bit: the value is stored")
    pool = PoolFactory(benchmark_timeout=300)
    operator_api.raise_request_exception = False

    response = post_raw(operator_api, f"/plumbing/pools/{pool.pk}/timeout", '{"benchmark_timeout": 1099511627776}')

    assert_problem(response, 400, "value_out_of_range")
    pool.refresh_from_db()
    assert pool.benchmark_timeout == 300
