"""A control byte in a header value (RFC 9110 5.5) is 400 problem+json ``invalid_header_value``:
the answer the shipped nginx gives too (tests/project/test_proxy.py), where gunicorn alone would
answer its own HTML page."""

import pytest

from tests.problems import assert_problem


@pytest.mark.parametrize("value", ["a\x7fb", "a\x01", "\x1bx", "a\x0bb"])
def test_a_control_byte_in_a_header_value_is_a_problem(client, value):
    response = client.get("/api/v1/nodes", HTTP_USER_AGENT=value)

    body = assert_problem(response, 400, "invalid_header_value")
    assert body["header"] == "User-Agent"


def test_a_tab_in_a_header_value_is_allowed(client):
    assert client.get("/healthz", HTTP_USER_AGENT="a\tb").status_code == 200
