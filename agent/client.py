"""A small synchronous client for the node side of the nodepool API (docs/api-contract.md).

Every failure becomes one of three exceptions, so that the agent's loop decides what to do
from the kind of failure and never from string matching:

* :class:`ServerUnavailable` — no answer, a 5xx, or 429: retry later with backoff
  (``retry_after`` carries the server's ``Retry-After`` when it sent one);
* :class:`ApiError` — the server answered with a 4xx problem: ``status`` and the stable ``code``;
* :class:`NodeRetired` (a 410 ``node_retired`` on a node endpoint) — stop for good.
"""

from __future__ import annotations

from typing import Any

import httpx

from . import __version__

USER_AGENT = f"nodepool-agent/{__version__}"


class ServerUnavailable(Exception):
    """The control plane did not answer usefully (network error, timeout, 5xx, 429)."""

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class ApiError(Exception):
    """A 4xx problem+json answer. ``code`` is the problem's stable code (or ``http_<status>``)."""

    def __init__(self, status: int, code: str, detail: str = "", body: Any = None):
        super().__init__(f"{status} {code}: {detail}".strip())
        self.status, self.code, self.detail, self.body = status, code, detail, body


class NodeRetired(ApiError):
    """The control plane retired this node (410 ``node_retired``): the agent must stop."""


def api_base(url: str) -> str:
    """``http://cp:8000`` or ``http://cp:8000/api/v1/`` → ``http://cp:8000/api/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/api/v1") else url + "/api/v1"


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare from our server; fall back to our own backoff


class NodeClient:
    """The calls a node makes. ``transport`` lets tests plug in ``httpx.MockTransport``.

    Args:
        url: the control plane's base URL (``/api/v1`` is appended if missing).
        timeout: seconds per request (connect, read, write, pool).
        verify: TLS verification (``True``, ``False`` or a CA bundle path).
    """

    def __init__(self, url: str, *, timeout: float = 10.0, verify: bool | str = True, transport=None):
        self.base = api_base(url)
        self.http = httpx.Client(
            base_url=self.base,
            timeout=timeout,
            verify=verify,
            transport=transport,
            headers={"User-Agent": USER_AGENT, "Accept": "application/json"},
        )
        self.credential = ""

    def close(self) -> None:
        self.http.close()

    # -- plumbing ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, json: Any = None, auth: bool = True) -> dict:
        headers = {"Authorization": f"Node {self.credential}"} if auth and self.credential else {}
        try:
            response = self.http.request(method, path, json=json, headers=headers)
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 429 or response.status_code >= 500:
            raise ServerUnavailable(f"{method} {path}: HTTP {response.status_code}", retry_after=_retry_after(response))
        try:
            body = response.json() if response.content else {}
        except ValueError:
            body = {"detail": response.text[:200]}
        if response.status_code >= 400:
            code = body.get("code") if isinstance(body, dict) else None
            detail = body.get("detail", "") if isinstance(body, dict) else ""
            cls = NodeRetired if response.status_code == 410 and code == "node_retired" else ApiError
            raise cls(response.status_code, code or f"http_{response.status_code}", str(detail), body)
        return body if isinstance(body, dict) else {"data": body}

    # -- the node's calls ----------------------------------------------------------------------
    def enroll(self, payload: dict) -> dict:
        """``POST /node-enrollments`` (no Authorization header; the bootstrap token is in the body)."""
        return self._request("POST", "/node-enrollments", json=payload, auth=False)

    def heartbeat(self, node_id: str, payload: dict) -> dict:
        return self._request("POST", f"/nodes/{node_id}/heartbeats", json=payload)

    def renew(self, node_id: str, payload: dict) -> dict:
        """``POST /nodes/{id}/renewals`` with ``{"incarnation", "sequence"}`` (docs/api-contract.md)."""
        return self._request("POST", f"/nodes/{node_id}/renewals", json=payload)

    def rotate_credential(self, node_id: str) -> dict:
        return self._request("POST", f"/nodes/{node_id}/credentials/rotate", json={})

    def post_benchmark(self, node_id: str, nonce: str, result: dict) -> dict:
        return self._request("POST", f"/nodes/{node_id}/benchmarks/{nonce}", json=result)

    def preemption_notice(self, node_id: str, deadline: str) -> dict:
        """``POST /nodes/{id}/preemption-notice`` ``{"deadline": RFC 3339}`` (a spot reclaim)."""
        return self._request("POST", f"/nodes/{node_id}/preemption-notice", json={"deadline": deadline})

    def lease_event(self, lease_id: str, payload: dict) -> dict:
        return self._request("POST", f"/node-leases/{lease_id}/events", json=payload)
