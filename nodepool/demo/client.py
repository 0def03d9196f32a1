"""The operator's view: an httpx client on the public API with the operator's token, and polling."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx


class ApiError(Exception):
    """An answer the story did not expect: method, path, status and the problem's detail."""

    def __init__(self, response: httpx.Response):
        self.response = response
        try:
            body = response.json()
        except ValueError:
            body = {"detail": response.text[:300]}
        self.body = body if isinstance(body, dict) else {"detail": str(body)}
        super().__init__(
            f"{response.request.method} {response.request.url.path} → {response.status_code} "
            f"{self.body.get('code', '')}: {self.body.get('detail', '')}"
        )


class Api:
    """Thin wrapper: ``get``/``post`` return the parsed JSON or raise :class:`ApiError`.

    ``expect`` lists the statuses that count as an answer (default: 2xx); ``raw`` returns the
    response itself for the steps that check an error on purpose (a 409 unschedulable).
    """

    def __init__(self, base_url: str, token: str, timeout: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.client = httpx.Client(
            base_url=self.base_url + "/api/v1",
            headers={"Authorization": f"Token {token}", "Accept": "application/json"},
            timeout=timeout,
        )

    def close(self) -> None:
        self.client.close()

    def request(self, method: str, path: str, *, expect=None, **kwargs) -> httpx.Response:
        # The web server shares a 2-core machine with the fleet: a connection hiccup is retried.
        for attempt in range(5):
            try:
                response = self.client.request(method, path, **kwargs)
                break
            except httpx.TransportError:
                if attempt == 4:
                    raise
                time.sleep(1 + attempt)
        if not (response.is_success if expect is None else response.status_code in expect):
            raise ApiError(response)
        return response

    def get(self, path: str, **params) -> Any:
        return self.request("GET", path, params=params or None).json()

    def post(self, path: str, body: dict | None = None, *, headers: dict | None = None) -> Any:
        return self.request("POST", path, json=body or {}, headers=headers).json()

    def raw(self, method: str, path: str, **kwargs) -> httpx.Response:
        return self.request(method, path, expect=range(100, 600), **kwargs)

    def all(self, path: str, **params) -> list[dict]:
        """Every item of a paginated list."""
        items: list[dict] = []
        page = 1
        while True:
            answer = self.get(path, page=page, page_size=500, **params)
            items.extend(answer.get("results", []))
            if not answer.get("next"):
                return items
            page += 1

    def node(self, node_id: str) -> dict:
        return self.get(f"/nodes/{node_id}")

    def etag(self, path: str) -> str:
        """The ``ETag`` of a ``GET`` (``"<version>.<digest>"``, quoted), for an operator action's ``If-Match``."""
        return self.request("GET", path).headers["ETag"]

    def lease(self, lease_id: str) -> dict:
        return self.get(f"/node-leases/{lease_id}")

    def ready(self) -> bool:
        try:
            return httpx.get(self.base_url + "/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


class TimedOut(Exception):
    pass


def poll(fetch: Callable[[], Any], check: Callable[[Any], bool], *, timeout: float, what: str, interval: float = 1.0):
    """Fetch until ``check(value)`` holds; returns the value. Raises :class:`TimedOut` naming
    ``what`` and the last value seen. Transient API errors are retried until the timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = fetch()
            if check(last):
                return last
        except (ApiError, httpx.TransportError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise TimedOut(f"timed out after {timeout:.0f} s waiting for {what}; last seen: {_short(last)}")
        time.sleep(interval)


def _short(value: Any) -> str:
    if isinstance(value, dict):
        keys = ("lifecycle", "liveness", "state", "incarnation", "lifecycle_reason", "code", "detail")
        return str({k: value[k] for k in keys if k in value}) or str(value)[:200]
    return str(value)[:300]
