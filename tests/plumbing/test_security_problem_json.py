"""problem+json, always, under /api/ and the probes (issue 11, item 4); header limits (431)."""

from __future__ import annotations

import httpx
import pytest

from tests.problems import assert_problem
from tests.processes import ROOT, VENV_BIN, child_env, free_port, running, wait_for

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.mark.django_db
@pytest.mark.parametrize("accept", [BROWSER_ACCEPT, "text/html", "application/json", "*/*", "text/plain"])
@pytest.mark.parametrize(
    ("who", "path", "status"),
    [
        ("anon", "/api/v1/nodes", 401),
        ("client", "/api/v1/bootstrap-tokens", 403),
        ("operator", "/api/v1/nodes/00000000-0000-0000-0000-000000000000", 404),
        ("operator", "/api/v1/no-such-thing", 404),
    ],
)
def test_an_api_error_is_problem_json_whatever_the_accept_header(
    anon_api, client_api, operator_api, accept, who, path, status
):
    api = {"anon": anon_api, "client": client_api, "operator": operator_api}[who]

    response = api.get(path, HTTP_ACCEPT=accept)

    # Accept: text/plain alone cannot be served by an API view: 406, still problem+json.
    expected = 406 if accept == "text/plain" and response.status_code == 406 else status
    assert_problem(response, expected)
    assert b"<html" not in response.content.lower() and len(response.content) < 2000


@pytest.mark.django_db
def test_the_browsable_api_still_serves_html_for_successes(operator_api):
    response = operator_api.get("/api/v1/pools", HTTP_ACCEPT="text/html")

    assert response.status_code == 200 and response["Content-Type"].startswith("text/html")


@pytest.mark.django_db
def test_the_admin_login_page_stays_html(client):
    response = client.get("/admin/login/", HTTP_ACCEPT="text/html")

    assert response.status_code == 200 and response["Content-Type"].startswith("text/html")


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/nodes", "/healthz", "/readyz"])
def test_a_header_above_the_app_limit_is_431_problem_json(client, path):
    response = client.get(path, HTTP_X_PADDING="x" * 10_000, HTTP_ACCEPT="text/html")

    body = assert_problem(response, 431, "header_too_large")
    assert body["header"] == "X-Padding" and body["limit"] == 8192


@pytest.mark.django_db
def test_many_headers_adding_up_above_the_total_limit_are_431(client):
    headers = {f"HTTP_X_PAD_{i}": "y" * 4000 for i in range(10)}

    assert_problem(client.get("/api/v1/", **headers), 431, "headers_too_large")


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_gunicorn_lets_the_app_answer_431_and_refuses_beyond_its_own_limit(tmp_path):
    port = free_port()
    log = tmp_path / "gunicorn.log"
    args = [str(VENV_BIN / "gunicorn"), "nodepool.wsgi:application", "--bind", f"127.0.0.1:{port}", "--workers", "1"]
    with running(args, child_env(tmp_path), log):
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(base, {}) is not None, 30, "gunicorn", log)

        app = _get(base, {"X-Padding": "x" * 10_000, "Accept": "text/html"})
        beyond = _get(base, {"X-Padding": "x" * 20_000})

    assert app.status_code == 431 and app.headers["content-type"] == "application/problem+json"
    assert app.json()["code"] == "header_too_large"
    assert beyond.status_code in (400, 431)  # gunicorn's own refusal, documented in docs/foundation.md
    assert (ROOT / "gunicorn.conf.py").exists()


def _get(base: str, headers: dict):
    try:
        return httpx.get(base + "/healthz", headers=headers, timeout=5)
    except httpx.HTTPError:
        return None
