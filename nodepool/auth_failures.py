"""Failed authentication, limited per client address and per account (issue 30, item 4).

**Per client address** (user tokens and node credentials). Every refused credential — a 401 from
``Authorization: Token|Bearer|Node …``, whichever view answered it — adds one to the address's
counter for the current fixed window (``NODEPOOL_AUTH_FAILURE_WINDOW_SECONDS``, 60 s): one
``INSERT … ON CONFLICT DO UPDATE … RETURNING`` on a small table (:class:`nodepool.models.AuthFailureCount`),
so the counter survives a Redis outage and every process adds to the same one. When the count
reaches ``NODEPOOL_AUTH_FAILURE_LIMIT`` (60) the process that saw it remembers the address as
blocked until the window ends, and :class:`FailedAuthGate` (a middleware, before the database
deadline, sessions and authentication) answers that address's credential-bearing requests 429
``auth_failures_throttled`` with ``Retry-After``, before any lookup or hash comparison. Another
process learns of the block with the first failure it records itself, so an address gets at most
one extra expensive attempt per web process and window.

What the limit costs valid traffic: nothing on a valid request while no address is blocked (one
empty-dict test; a success is remembered as a 16-byte fingerprint in a bounded dict). While an
address is blocked, a credential this process accepted in the last
``NODEPOOL_AUTH_GOOD_MEMORY_SECONDS`` (15 min) still passes the gate, so healthy nodes behind the
same NAT as a broken or hostile one keep renewing; only unknown credentials are refused unread.
IPv6 clients are counted per /64 (one subscriber's prefix), IPv4 per address.

**Per account** (password logins: the admin's and the browsable API's, behind django-axes' lockout
per username and address). Every failed login adds one to the account's counter
(``NODEPOOL_LOGIN_ACCOUNT_WINDOW_MINUTES``, 15). At ``NODEPOOL_LOGIN_ACCOUNT_FAILURE_LIMIT`` (20)
failures across all addresses, logins to that account from *unfamiliar* addresses are refused
(429, password not checked) until the window ends or ``manage.py unlock_login <username>`` lifts
it. A familiar address — one this account logged in from successfully in the last
``NODEPOOL_LOGIN_FAMILIAR_DAYS`` (90; django-axes' access log) — is never refused by the ceiling,
so a distributed guesser slows to the ceiling's rate without locking the real operator out
(docs/foundation.md, "Failed authentication").
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import threading
import time
from datetime import timedelta

from axes.models import AccessLog
from django.db import DatabaseError, connection
from django.utils import timezone

from nodepool.api.errors import AUTH_FAILURES_THROTTLED
from nodepool.api.problems import problem_response
from nodepool.api.throttling import client_address
from nodepool.models import AuthFailureCount

from . import conf

logger = logging.getLogger(__name__)

ADDRESS = "address"
LOGIN = "login"

# The credential schemes whose failures count (lower-case, as bytes of the Authorization header).
_SCHEMES = (b"token", b"bearer", b"node")

# address key -> unix time its block ends (this process).
_blocked: dict[str, float] = {}
# credential fingerprint -> monotonic time this process last accepted it.
_good: dict[bytes, float] = {}
_GOOD_MAX = 200_000
_lock = threading.Lock()


def address_limit() -> int:
    return conf.get("AUTH_FAILURE_LIMIT")


def address_window() -> int:
    """The per-address window (seconds, at least 1)."""
    return max(1, conf.get("AUTH_FAILURE_WINDOW_SECONDS"))


def account_limit() -> int:
    return conf.get("LOGIN_ACCOUNT_FAILURE_LIMIT")


def account_window() -> int:
    """The per-account window (seconds, at least a minute)."""
    return max(60, conf.get("LOGIN_ACCOUNT_WINDOW_MINUTES") * 60)


def address_key(address: str) -> str:
    """The key an address is counted under: IPv4 as is, IPv6 as its /64; anything else as given."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:200]
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def count_failure(scope: str, key: str, window_seconds: int, now: float | None = None) -> tuple[int, float]:
    """Add one failure to ``(scope, key)`` in the current window; returns ``(count so far in this
    window, unix time the window ends)``. One atomic upsert (PostgreSQL and SQLite ≥ 3.35): racing
    processes each get a distinct count.

    Raises:
        DatabaseError: the database refused or is unreachable (callers decide whether to fail open).
    """
    now = time.time() if now is None else now
    window = int(now // window_seconds)
    quote = connection.ops.quote_name
    table = quote("nodepool_authfailurecount")
    sql = (
        f"INSERT INTO {table} ({quote('scope')}, {quote('key')}, {quote('window')}, {quote('count')}) "  # noqa: S608
        f"VALUES (%s, %s, %s, 1) ON CONFLICT ({quote('scope')}, {quote('key')}, {quote('window')}) "
        f"DO UPDATE SET {quote('count')} = {table}.{quote('count')} + 1 RETURNING {quote('count')}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [scope, key, window])
        (count,) = cursor.fetchone()
    return count, (window + 1) * window_seconds


def failures(scope: str, key: str, window_seconds: int, now: float | None = None) -> tuple[int, float]:
    """``(failures of (scope, key) in the current window, unix time the window ends)``."""
    now = time.time() if now is None else now
    window = int(now // window_seconds)
    row = AuthFailureCount.objects.filter(scope=scope, key=key, window=window).values_list("count", flat=True)
    return next(iter(row), 0), (window + 1) * window_seconds


def forget(scope: str, key: str) -> int:
    """Delete every counter of ``(scope, key)`` (``manage.py unlock_login``); returns how many."""
    if scope == ADDRESS:
        _blocked.pop(key, None)
    return AuthFailureCount.objects.filter(scope=scope, key=key).delete()[0]


def prune(now: float | None = None) -> int:
    """Delete counters of windows that ended more than a day ago (hourly task); returns how many."""
    cutoff = (time.time() if now is None else now) - 86400
    deleted = 0
    for scope, seconds in ((ADDRESS, address_window()), (LOGIN, account_window())):
        deleted += AuthFailureCount.objects.filter(scope=scope, window__lt=int(cutoff // seconds)).delete()[0]
    return deleted


# --- per address: user tokens and node credentials -------------------------------------------------


def _credential(authorization: str) -> bytes | None:
    """The raw credential of a Token/Bearer/Node Authorization header, else None."""
    try:
        parts = authorization.encode("iso-8859-1").split()
    except UnicodeEncodeError:
        return None
    if len(parts) != 2 or parts[0].lower() not in _SCHEMES:
        return None
    return parts[1]


def _fingerprint(credential: bytes) -> bytes:
    return hashlib.blake2b(credential, digest_size=16).digest()


def remember_good(authorization: str) -> None:
    """Note that this process accepted the credential of ``authorization`` (see the module docstring)."""
    credential = _credential(authorization)
    if credential is None:
        return
    if len(_good) >= _GOOD_MAX:
        _good.clear()
    _good[_fingerprint(credential)] = time.monotonic()


def blocked_wait(request) -> float | None:
    """Seconds until ``request``'s address may present unknown credentials again, or None when
    it may now (or the request carries no Token/Bearer/Node credential, or one this process
    accepted recently)."""
    if not _blocked:
        return None
    key = address_key(client_address(request))
    until = _blocked.get(key)
    if until is None:
        return None
    wait = until - time.time()
    if wait <= 0:
        with _lock:
            if _blocked.get(key, 0) <= time.time():
                _blocked.pop(key, None)
        return None
    credential = _credential(request.META.get("HTTP_AUTHORIZATION", ""))
    if credential is None:
        return None
    seen = _good.get(_fingerprint(credential))
    if seen is not None and time.monotonic() - seen < conf.get("AUTH_GOOD_MEMORY_SECONDS"):
        return None
    return wait


def record_failure(request) -> None:
    """Count a refused credential against ``request``'s address; block the address in this
    process when the window's count reaches the limit. A request without a Token/Bearer/Node
    credential is not counted. A database error is logged and swallowed (the 401 stands)."""
    if _credential(request.META.get("HTTP_AUTHORIZATION", "")) is None:
        return
    limit = address_limit()
    if limit <= 0:
        return
    key = address_key(client_address(request))
    try:
        count, ends = count_failure(ADDRESS, key, address_window())
    except DatabaseError as exc:
        logger.warning("failed-authentication counter not updated (%s: %s)", type(exc).__name__, exc)
        return
    if count >= limit:
        with _lock:
            first = key not in _blocked
            _blocked[key] = ends
        if first:
            logger.warning("authentication failures from %s: %d in this window; refused until its end", key, count)


def throttled_response(request, wait: float):
    """The 429 ``auth_failures_throttled`` problem answered to a blocked address."""
    seconds = max(1, math.ceil(wait))
    response = problem_response(
        429,
        AUTH_FAILURES_THROTTLED,
        "Too many failed authentications from this address; wait before presenting a credential again.",
        retry_after=seconds,
        request_id=getattr(request, "request_id", ""),
    )
    response["Retry-After"] = str(seconds)
    response._has_been_logged = True  # counted, not logged line by line during a flood
    return response


class FailedAuthGate:
    """Middleware, right after the request id: an address over its failed-authentication limit
    gets 429 for any credential this process has not accepted recently, before the database,
    sessions and authentication are touched. Free while no address is blocked."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if _blocked:
            wait = blocked_wait(request)
            if wait is not None:
                return throttled_response(request, wait)
        return self.get_response(request)


def reset_process_state() -> None:
    """Forget this process's blocks and accepted credentials (tests)."""
    _blocked.clear()
    _good.clear()


# --- per account: password logins -----------------------------------------------------------------


def is_familiar(username: str, address: str, now=None) -> bool:
    """Did ``username`` log in successfully from ``address`` within ``NODEPOOL_LOGIN_FAMILIAR_DAYS``?
    (django-axes' access log, one row per successful login.)"""
    since = (now or timezone.now()) - timedelta(days=conf.get("LOGIN_FAMILIAR_DAYS"))
    return AccessLog.objects.filter(username=username, ip_address=address, attempt_time__gte=since).exists()


def account_wait(username: str, address: str) -> float | None:
    """Seconds until ``username`` accepts logins from ``address`` again, or None when it does now:
    the account's failures across addresses in this window are below the ceiling, or the address
    is familiar."""
    limit = account_limit()
    if not username or limit <= 0:
        return None
    count, ends = failures(LOGIN, username, account_window())
    if count < limit or is_familiar(username, address):
        return None
    return max(1.0, ends - time.time())


def count_login_failure(username: str) -> int:
    """Add a failed login to ``username``'s account counter; returns the window's count."""
    if not username or account_limit() <= 0:
        return 0
    return count_failure(LOGIN, username, account_window())[0]
