"""Every API error is problem+json with a stable code, and bad input never gets a 500."""

from __future__ import annotations

import io
import json

import pytest
from django.core.cache import cache

from tests.factories import PoolFactory
from tests.problems import assert_problem

pytestmark = [pytest.mark.urls("tests.plumbing_urls"), pytest.mark.django_db]


@pytest.fixture(autouse=True)
def _fresh_throttle_counts():
    cache.clear()
    yield
    cache.clear()


def post_json(api, path, body, **extra):
    return api.generic(
        "POST",
        path,
        body if isinstance(body, bytes | str) else json.dumps(body),
        content_type="application/json",
        **extra,
    )


def test_valid_body_is_accepted(anon_api):
    response = post_json(anon_api, "/plumbing/echo", {"name": "ok", "count": 1})
    assert response.status_code == 200
    assert response.json() == {"name": "ok", "count": 1}


def test_validation_errors_list_every_offending_field(anon_api):
    response = post_json(
        anon_api, "/plumbing/echo", {"name": "x" * 11, "items": [{"name": "ok"}, {"name": "ok", "tags": ["toolong"]}]}
    )

    body = assert_problem(response, 400, "validation_error")
    fields = {e["field"]: e for e in body["errors"]}
    assert set(fields) == {"name", "count", "items[1].tags[0]"}
    assert fields["count"]["code"] == "required"
    assert fields["name"]["code"] == "max_length"
    assert "name" in body["detail"] and "count" in body["detail"]


def test_an_object_level_validation_error_has_no_field_but_keeps_its_code(anon_api):
    response = post_json(anon_api, "/plumbing/echo", {"name": "forbidden", "count": 1})

    body = assert_problem(response, 400, "validation_error")
    assert body["errors"] == [{"field": "", "code": "reserved_name", "message": "This name is reserved."}]
    assert "reserved" in body["detail"]


def test_malformed_json_is_400(anon_api):
    body = assert_problem(post_json(anon_api, "/plumbing/echo", b'{"name": "ok",'), 400, "malformed_body")
    assert "JSON" in body["detail"]


def test_a_body_that_is_not_utf8_is_400(anon_api):
    assert_problem(post_json(anon_api, "/plumbing/echo", b'{"name": "\xff\xfe"}'), 400, "malformed_body")


def test_a_json_array_where_an_object_is_expected_is_a_validation_error(anon_api):
    assert_problem(post_json(anon_api, "/plumbing/echo", [1, 2]), 400, "validation_error")


def test_unsupported_media_type_is_415(anon_api):
    response = anon_api.generic("POST", "/plumbing/echo", "name=ok", content_type="application/x-www-form-urlencoded")
    assert_problem(response, 415, "unsupported_media_type")


def test_wrong_method_is_405_with_allow(anon_api):
    response = anon_api.get("/plumbing/echo")
    assert_problem(response, 405, "method_not_allowed")
    assert "POST" in response["Allow"]


def test_unknown_path_is_404(anon_api):
    assert_problem(anon_api.get("/api/v1/no-such-thing"), 404, "not_found")
    assert_problem(anon_api.get("/nothing/here/at/all"), 404, "not_found")


def test_missing_object_is_404(operator_api):
    assert_problem(operator_api.get("/plumbing/pools/999999"), 404, "not_found")


def test_a_huge_id_in_the_path_is_404(operator_api):
    assert_problem(operator_api.get("/plumbing/pools/99999999999999999999999999"), 404, "not_found")


def test_a_number_the_column_cannot_hold_is_400_and_changes_nothing(operator_api):
    pool = PoolFactory(benchmark_timeout=300)
    operator_api.raise_request_exception = False

    response = post_json(operator_api, f"/plumbing/pools/{pool.pk}/timeout", {"benchmark_timeout": 10**30})

    # Beyond 64 bits the parser refuses it before any view runs (tests/plumbing/test_hardening_json.py).
    assert_problem(response, 400, "number_out_of_range")
    pool.refresh_from_db()
    assert pool.benchmark_timeout == 300


def test_a_uniqueness_clash_the_view_did_not_check_is_409(operator_api):
    pool = PoolFactory(name="alpha")
    PoolFactory(name="beta")
    operator_api.raise_request_exception = False

    response = post_json(operator_api, f"/plumbing/pools/{pool.pk}/timeout", {"benchmark_timeout": 1, "name": "beta"})

    assert_problem(response, 409, "integrity_error")
    pool.refresh_from_db()
    assert (pool.name, pool.benchmark_timeout) == ("alpha", 300)


def test_declared_body_over_the_project_limit_is_413_before_it_is_read(anon_api, settings):
    settings.NODEPOOL_MAX_BODY_BYTES = 1000
    body = json.dumps({"name": "ok", "count": 1, "pad": "x" * 2000})

    response = post_json(anon_api, "/plumbing/echo", body)

    problem = assert_problem(response, 413, "payload_too_large")
    assert problem["limit"] == 1000


def test_declared_body_over_a_views_tighter_limit_is_413(anon_api):
    response = post_json(anon_api, "/plumbing/small", {"name": "ok", "count": 1, "pad": "x" * 200})
    assert_problem(response, 413, "payload_too_large")


def chunked(api, path, payload: bytes):
    """POST ``payload`` the way a WSGI server presents a chunked body: no Content-Length."""
    return api.generic(
        "POST",
        path,
        content_type="application/json",
        CONTENT_LENGTH="",
        HTTP_TRANSFER_ENCODING="chunked",
        **{"wsgi.input": io.BytesIO(payload)},
    )


def test_chunked_body_over_the_limit_is_413(anon_api, settings):
    settings.NODEPOOL_MAX_BODY_BYTES = 1000
    payload = json.dumps({"name": "ok", "count": 1, "pad": "x" * 5000}).encode()

    response = chunked(anon_api, "/plumbing/echo", payload)

    assert_problem(response, 413, "payload_too_large")
    assert "Connection" not in response  # hop-by-hop: not the application's to send (PEP 3333)


def test_chunked_body_within_the_limit_is_parsed_not_dropped(anon_api):
    response = chunked(anon_api, "/plumbing/echo", json.dumps({"name": "ok", "count": 2}).encode())
    assert response.status_code == 200
    assert response.json() == {"name": "ok", "count": 2}


def test_chunked_body_over_a_views_tighter_limit_is_413(anon_api):
    payload = json.dumps({"name": "ok", "count": 1, "pad": "x" * 200}).encode()
    assert_problem(chunked(anon_api, "/plumbing/small", payload), 413, "payload_too_large")


def test_deeply_nested_json_is_422(anon_api):
    nested = "[" * 50 + "]" * 50
    assert_problem(post_json(anon_api, "/plumbing/echo", nested), 422, "json_too_deep")


def test_json_nested_beyond_the_parsers_recursion_limit_is_422_not_500(anon_api):
    nested = "[" * 100_000 + "]" * 100_000
    assert_problem(post_json(anon_api, "/plumbing/echo", nested), 422, "json_too_deep")


def test_a_views_tighter_depth_limit_applies(anon_api):
    response = post_json(anon_api, "/plumbing/small", {"name": "ok", "count": 1, "a": {"b": {"c": {"d": 1}}}})
    assert_problem(response, 422, "json_too_deep")


def test_throttling_is_429_with_retry_after(anon_api):
    assert anon_api.get("/plumbing/throttled").status_code == 200
    assert anon_api.get("/plumbing/throttled").status_code == 200

    response = anon_api.get("/plumbing/throttled")

    body = assert_problem(response, 429, "throttled")
    assert int(response["Retry-After"]) > 0
    assert body["retry_after"] == int(response["Retry-After"])


def test_a_client_asking_for_problem_json_gets_it(anon_api):
    response = post_json(anon_api, "/plumbing/echo", {"name": "ok"}, HTTP_ACCEPT="application/problem+json")
    assert_problem(response, 400, "validation_error")


def test_an_accept_header_nothing_can_satisfy_is_406(anon_api):
    response = post_json(anon_api, "/plumbing/echo", {"name": "ok", "count": 1}, HTTP_ACCEPT="application/xml")
    assert_problem(response, 406, "not_acceptable")


def test_errors_carry_the_request_id(anon_api):
    response = post_json(anon_api, "/plumbing/echo", b"{", HTTP_X_REQUEST_ID="req-123")
    body = assert_problem(response, 400, "malformed_body")
    assert body["request_id"] == "req-123"
    assert response["X-Request-ID"] == "req-123"


def test_an_unexpected_exception_is_a_problem_json_500_without_internals(anon_api):
    anon_api.raise_request_exception = False
    response = anon_api.get("/plumbing/crash")
    body = assert_problem(response, 500, "internal_error")
    assert "boom" not in json.dumps(body)


BAD_BODIES = [
    b"",
    b"null",
    b"[]",
    b'"a string"',
    b"1e999999",
    b"NaN",
    b'{"name": null, "count": null}',
    b'{"name": 1, "count": "many"}',
    b'{"name": "ok", "count": 1e400}',
    b'{"name": "ok", "count": 1, "items": "nope"}',
    b'{"name": "ok", "count": 1, "items": [null, 3, []]}',
    b'{"name": "\\ud800", "count": 1}',
    b'{"name": "a\\u0000b", "count": 1}',
    b"\x00\x01\x02",
]


@pytest.mark.parametrize("payload", BAD_BODIES)
def test_no_bad_body_gets_a_500(anon_api, payload):
    anon_api.raise_request_exception = False
    response = post_json(anon_api, "/plumbing/echo", payload)
    assert 400 <= response.status_code < 500, (response.status_code, response.content[:300])
    if response.status_code != 200:
        assert response["Content-Type"] == "application/problem+json"
