"""Assertion helper for problem+json answers, usable from any test file."""

from __future__ import annotations

PROBLEM_MEMBERS = {"type", "title", "status", "detail", "code"}


def assert_problem(response, status: int, code: str | None = None) -> dict:
    """Assert ``response`` is an RFC 9457 problem with ``status`` (and ``code``); return its body."""
    assert response.status_code == status, (response.status_code, getattr(response, "content", b"")[:500])
    assert response["Content-Type"].split(";")[0] == "application/problem+json", response["Content-Type"]
    body = response.json()
    assert set(body) >= PROBLEM_MEMBERS, body
    assert body["status"] == status
    assert body["type"].startswith("https://") and body["title"] and body["detail"]
    if code is not None:
        assert body["code"] == code, body
    return body
