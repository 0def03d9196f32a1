"""``POST /api/v1/nodes/{id}/renewals``: the liveness renewal (node credential only).

A plain Django view, not DRF: the renewal is the hottest path of the control plane and its
whole job is one statement (fleet.renewals), so the request is read and answered by hand. The
rules are the heartbeat's (docs/api-contract.md): 401 for an unknown, revoked or expired
credential, 403 for another node's, 410 for a retired node, ordering codes in a 200, 413 beyond
256 bytes, 400 for a malformed body, 429 with ``Retry-After`` when sooner than half the interval.
Every error is problem+json with a stable ``code``, and nothing is written for any of them.
"""

from __future__ import annotations

import json
import re
import uuid

from django.http import HttpResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from nodepool.api.errors import (
    AUTHENTICATION_FAILED,
    MALFORMED_BODY,
    METHOD_NOT_ALLOWED,
    PAYLOAD_TOO_LARGE,
    UNSUPPORTED_MEDIA_TYPE,
    VALIDATION_ERROR,
)
from nodepool.api.parsers import loads_strict
from nodepool.api.problems import Problem, problem_response
from nodepool.auth_failures import record_failure, remember_good

from .. import metrics
from .. import renewals as rn
from .. import secrets as node_secrets
from ..authentication import node_secret
from ..heartbeats import MAX_COUNTER

_ALLOWED_KEYS = frozenset({"incarnation", "sequence"})


def _problem(request, status: int, code: str, detail: str, headers: dict | None = None, **extra) -> HttpResponse:
    metrics.count(metrics.RENEWAL, code)
    response = problem_response(status, code, detail, request_id=getattr(request, "request_id", ""), **extra)
    if status == 429:
        # A flood is answered, counted (nodepool_heartbeats_total) and not logged line by line:
        # Django's "Too Many Requests" warning per refusal would cost more than the refusal.
        response._has_been_logged = True
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def _counter(body: dict, name: str, minimum: int) -> int | None:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < MAX_COUNTER:
        return None
    return value


@csrf_exempt
def renewal_view(request, pk):
    """Renew node ``pk``'s liveness. Body ``{"incarnation": int ≥ 1, "sequence": int ≥ 0}`` (≤ 256
    bytes); answer ``{"applied", "code", "next_renewal_in", "renewal_interval", "flags"}`` (docs/api-contract.md)."""
    if request.method != "POST":
        response = _problem(request, 405, METHOD_NOT_ALLOWED, f'Method "{request.method}" not allowed.')
        response["Allow"] = "POST"
        return response
    declared = request.META.get("CONTENT_LENGTH") or "0"
    if int(declared) > rn.MAX_BODY_BYTES or len(request.body) > rn.MAX_BODY_BYTES:
        return _problem(
            request, 413, PAYLOAD_TOO_LARGE, f"A renewal is at most {rn.MAX_BODY_BYTES} bytes.",
            limit=rn.MAX_BODY_BYTES,
        )  # fmt: skip
    secret = node_secret(request.META.get("HTTP_AUTHORIZATION", ""))
    if secret is None:
        return _problem(
            request, 401, AUTHENTICATION_FAILED, "A node credential is required (Authorization: Node <secret>).",
            headers={"WWW-Authenticate": "Node"}, reason="credential_missing",
        )  # fmt: skip
    content_type = request.META.get("CONTENT_TYPE", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        return _problem(request, 415, UNSUPPORTED_MEDIA_TYPE, "A renewal is application/json.")
    try:
        # The strict parser of every other endpoint (nodepool.api.parsers): a duplicate key, a
        # number past 64 bits, a NUL or a byte-order mark is refused here too, not guessed at.
        body = loads_strict(request.body.decode("utf-8"))
    except Problem as exc:
        return _problem(request, 400, exc.get_codes(), str(exc.detail))
    except (ValueError, UnicodeDecodeError):
        return _problem(request, 400, MALFORMED_BODY, "The body is not valid JSON.")
    errors = []
    if not isinstance(body, dict):
        errors.append({"field": "", "code": "invalid", "message": "Must be a JSON object."})
        body = {}
    incarnation = _counter(body, "incarnation", 1)
    sequence = _counter(body, "sequence", 0)
    if incarnation is None:
        errors.append({"field": "incarnation", "code": "invalid", "message": "An integer from 1 to 2**53 - 1."})
    if sequence is None:
        errors.append({"field": "sequence", "code": "invalid", "message": "An integer from 0 to 2**53 - 1."})
    for name in sorted(set(body) - _ALLOWED_KEYS):
        message = "A renewal carries only incarnation and sequence."
        errors.append({"field": name, "code": "unknown_field", "message": message})
    if errors:
        return _problem(request, 400, VALIDATION_ERROR, "Invalid renewal.", errors=errors)
    try:
        outcome = rn.renew(
            node_id=pk, secret=secret, incarnation=incarnation, sequence=sequence,
            request_id=getattr(request, "request_id", ""),
        )  # fmt: skip
    except Problem as exc:
        if exc.status_code == 401:
            record_failure(request)  # counts against the address (nodepool.auth_failures)
        headers = {}
        if getattr(exc, "auth_header", None):
            headers["WWW-Authenticate"] = exc.auth_header
        if getattr(exc, "wait", None):
            headers["Retry-After"] = str(exc.wait)
        return _problem(request, exc.status_code, exc.get_codes(), str(exc.detail), headers=headers, **exc.extra)
    remember_good(request.META.get("HTTP_AUTHORIZATION", ""))
    metrics.count(metrics.RENEWAL, outcome.code)
    metrics.prescribed(outcome.next_renewal_in)
    return HttpResponse(
        json.dumps(
            {"applied": outcome.applied, "code": outcome.code, "next_renewal_in": outcome.next_renewal_in,
             "renewal_interval": outcome.renewal_interval, "flags": outcome.flags},
            separators=(",", ":"),
        ),
        content_type="application/json",
    )  # fmt: skip


_RENEWAL_PATH = re.compile(r"^/api/v1/nodes/([0-9a-fA-F-]{32,36})/renewals$")


class RenewalFloodGate:
    """Middleware, right after the request id: a renewal this process already refused with 429
    (same node, credential and incarnation, still too soon) is refused again here, before
    sessions, authentication, logging and URL resolution.

    A flooding node keeps 50 requests in flight; each 429 then costs the workers a fraction of a
    full request, so the others' renewals wait less behind it. The answer is the view's own
    (``fleet.renewals.remembered_refusal``): same problem, same ``Retry-After``, same counter. A
    body over 256 bytes, an unparsable one or any request the memo does not cover goes on to the
    view as usual.
    """

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.method == "POST" and rn.has_refusals():
            match = _RENEWAL_PATH.fullmatch(request.path_info)
            if match is not None:
                refusal = self._refusal(request, match.group(1))
                if refusal is not None:
                    return _problem(
                        request, refusal.status_code, refusal.get_codes(), str(refusal.detail),
                        headers={"Retry-After": str(refusal.wait)}, **refusal.extra,
                    )  # fmt: skip
        return self.get_response(request)

    @staticmethod
    def _refusal(request, node_id: str):
        declared = request.META.get("CONTENT_LENGTH") or ""
        if not (declared.isascii() and declared.isdigit()) or int(declared) > rn.MAX_BODY_BYTES:
            # Chunked (no length) or odd: reading the body this early would cache what the body
            # limit middleware has not de-chunked yet (an empty body), for this request's view.
            return None
        try:
            secret = node_secret(request.META.get("HTTP_AUTHORIZATION", ""))
            body = json.loads(request.body)
            incarnation = body.get("incarnation") if isinstance(body, dict) else None
            if secret is None or not isinstance(incarnation, int):
                return None
            return rn.remembered_refusal(
                uuid.UUID(node_id), node_secrets.hash_secret(secret), incarnation, timezone.now()
            )
        except (ValueError, UnicodeDecodeError):
            return None
