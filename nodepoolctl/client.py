"""A thin client of nodepool's public API (``/api/v1``) over httpx: pagination, ETags, problems.

Every error becomes :class:`ApiError` with a one-line message: ``<status> <code>: <detail>``
for application/problem+json answers (RFC 9457), or what went wrong on the wire.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx

USER_AGENT = "nodepoolctl/0.1"
MAX_PAGES = 200  # 500 per page: 100,000 objects at most in one listing


# Codes whose detail only names the fields: the field messages say what is wrong. The last three
# are the names servers before round 3 answered for the same thing (docs/api-contract.md, changelog).
VALIDATION_CODES = frozenset({"validation_error", "invalid_request", "invalid_field", "invalid_upgrade"})


class ApiError(Exception):
    """An API call that did not succeed. ``status`` is the HTTP status (None: no answer); ``code``
    the problem's code and ``deprecated_code`` the older name a server also sends for one release."""

    def __init__(self, message: str, *, status: int | None = None, code: str = "", deprecated_code: str = ""):
        super().__init__(message)
        self.status = status
        self.code = code
        self.deprecated_code = deprecated_code

    def is_code(self, code: str) -> bool:
        """Whether the problem is ``code``, by its current or its deprecated name."""
        return code in (self.code, self.deprecated_code) and bool(code)


def _problem(response: httpx.Response) -> ApiError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        code = str(body.get("code") or "")
        deprecated = str(body.get("deprecated_code") or "")
        detail = body.get("detail") or body.get("title") or ""
        messages = _field_messages(body.get("errors"))
        if messages and code in VALIDATION_CODES:
            # The detail only names the fields ("Invalid input in: deadline_in."): say what is wrong.
            detail = messages
        elif messages and messages not in str(detail):
            detail = f"{detail} ({messages})"
        text = " ".join(str(detail).split())
        message = f"{response.status_code} {code}: {text}".strip()
        return ApiError(message, status=response.status_code, code=code, deprecated_code=deprecated)
    text = " ".join(response.text.split())[:200]
    return ApiError(f"{response.status_code} {response.reason_phrase}: {text}", status=response.status_code)


def _field_messages(errors) -> str:
    """``deadline_in: Too far away.; reason: This field is required.`` from a problem's ``errors``:
    a list of ``{"field", "code", "message"}`` (nodepool), or a ``{field: message}`` mapping."""
    if isinstance(errors, dict):
        errors = [{"field": k, "message": v} for k, v in errors.items()]
    if not isinstance(errors, list):
        return ""
    parts = []
    for error in errors:
        if isinstance(error, dict):
            field, message = error.get("field") or "", error.get("message") or error.get("code") or ""
            if isinstance(message, list):
                message = " ".join(str(m) for m in message)
            parts.append(f"{field}: {message}" if field else str(message))
        elif error:
            parts.append(str(error))
    return "; ".join(part for part in parts if part)


def is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


class Api:
    """``Api(url, token)``: ``url`` is the server's base (``http://host:8000``); ``token`` a user
    API token sent as ``Authorization: Token <key>``. ``transport`` is for tests only."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 15.0, transport=None):
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Token {token}"
        self.http = httpx.Client(base_url=f"{url}/api/v1", headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(f"cannot reach {self.http.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise _problem(response)
        return response

    def get(self, path: str, **params) -> dict:
        return self.request("GET", path, params=_params(params)).json()

    def get_with_version(self, path: str) -> tuple[dict, str]:
        """The object and its ETag, to send back as If-Match on an action."""
        response = self.request("GET", path)
        return response.json(), response.headers.get("ETag", "")

    def list(self, path: str, **params) -> list[dict]:
        """Every object of a paginated listing (following ``next``)."""
        return list(self.iter(path, **params))

    def iter(self, path: str, **params) -> Iterator[dict]:
        params = {"page_size": 500, **_params(params)}
        page = self.request("GET", path, params=params).json()
        for _ in range(MAX_PAGES):
            if not isinstance(page, dict) or "results" not in page:
                yield from page if isinstance(page, list) else [page]
                return
            yield from page["results"]
            if not page.get("next"):
                return
            page = self.request("GET", page["next"]).json()
        raise ApiError(f"more than {MAX_PAGES} pages at {path}; narrow the listing")

    def post(self, path: str, body: dict | None = None, *, etag: str = "", params: dict | None = None,
             headers: dict | None = None) -> httpx.Response:  # fmt: skip
        headers = dict(headers or {})
        if etag:
            headers["If-Match"] = etag
        return self.request("POST", path, json=body if body is not None else {}, params=params, headers=headers)

    def node(self, name_or_id: str) -> dict:
        """One node by id or by hostname (an ambiguous or unknown hostname is an error)."""
        if is_uuid(name_or_id):
            return self.get(f"/nodes/{name_or_id}")
        found = self.get("/nodes", hostname=name_or_id, page_size=2)["results"]
        if not found:
            raise ApiError(f"404 node_not_found: no node named {name_or_id!r}", status=404, code="node_not_found")
        if len(found) > 1:
            raise ApiError(f"several nodes are named {name_or_id!r}: give its id", code="ambiguous_name")
        return found[0]


def _params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None and v != [] and v != ""}
