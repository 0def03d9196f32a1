"""A per-request database deadline for web processes (issue 30, item 2).

A PostgreSQL server that accepts connections and never answers holds a request forever: the
connect timeout does not apply to a query on a connection already open (``CONN_MAX_AGE``), the
server-side ``statement_timeout`` never sees a query that never arrives, and TCP keepalives and
``tcp_user_timeout`` only notice a peer whose *kernel* stopped answering. So each web request gets
a deadline (``NODEPOOL_REQUEST_DB_DEADLINE`` seconds, 5 by default): one watchdog thread per
process looks every 0.2 s for requests past their deadline whose connection is waiting for the
server (libpq's transaction status ``ACTIVE``: a command is in progress), and shuts that
connection's socket down. The blocked query then fails at once with an ``OperationalError``, which
the API answers as 503 ``database_timeout`` with ``Retry-After`` (nodepool.api.problems), and
Django discards the connection at the end of the request. A request past its deadline that is not
waiting for the database is left alone (its next query, if any, is cut the same way).

PostgreSQL only (SQLite has no server to hang). ``timed_out()`` tells the error handler of the
request's own thread that the watchdog cut its connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

from django.conf import settings
from django.db import connections

logger = logging.getLogger(__name__)
TICK = 0.2

_active: dict[int, tuple[float, object]] = {}  # thread id -> (deadline, the thread's DatabaseWrapper)
_fired: set[int] = set()
_lock = threading.Lock()
_watchdog: threading.Thread | None = None


def timed_out() -> bool:
    """True in a request whose database connection the watchdog cut."""
    return threading.get_ident() in _fired


def _active_command(wrapper) -> int | None:
    """The socket of ``wrapper``'s psycopg connection if a command is in progress on it, else None."""
    from psycopg import pq  # only here: a SQLite deployment need not install the PostgreSQL driver

    connection = getattr(wrapper, "connection", None)
    if connection is None:
        return None
    try:
        pgconn = connection.pgconn
        if pgconn.transaction_status != pq.TransactionStatus.ACTIVE:
            return None
        return pgconn.socket
    except Exception:  # closed or closing meanwhile
        return None


def _cut(fd: int) -> None:
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


def _watch() -> None:
    while True:
        time.sleep(TICK)
        now = time.monotonic()
        with _lock:
            overdue = [(tid, entry) for tid, entry in _active.items() if entry[0] <= now and tid not in _fired]
        for tid, entry in overdue:
            fd = _active_command(entry[1])
            if fd is None:
                continue
            with _lock:
                if _active.get(tid) is not entry:
                    continue  # that request ended meanwhile
                _fired.add(tid)
            logger.warning("request passed its database deadline; cutting its connection")
            _cut(fd)


def _ensure_watchdog() -> None:
    global _watchdog
    if _watchdog is not None and _watchdog.is_alive():
        return
    with _lock:
        if _watchdog is None or not _watchdog.is_alive():
            _watchdog = threading.Thread(target=_watch, name="db-deadline", daemon=True)
            _watchdog.start()


class DatabaseDeadlineMiddleware:
    """Registers each request's deadline with the watchdog (PostgreSQL, deadline > 0 only)."""

    def __init__(self, get_response):
        self.get_response = get_response
        self.seconds = float(getattr(settings, "NODEPOOL_REQUEST_DB_DEADLINE", 0) or 0)
        self.enabled = self.seconds > 0 and connections["default"].vendor == "postgresql"

    def __call__(self, request):
        if not self.enabled:
            return self.get_response(request)
        _ensure_watchdog()
        tid = threading.get_ident()
        with _lock:
            _active[tid] = (time.monotonic() + self.seconds, connections["default"])
        try:
            return self.get_response(request)
        finally:
            with _lock:
                _active.pop(tid, None)
                _fired.discard(tid)
