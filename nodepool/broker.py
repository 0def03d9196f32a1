"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file, made to poll promptly.

Why this transport: it needs no server, and on SQLite it claims each message inside
``BEGIN IMMEDIATE`` so two consumers never take the same one; kombu's filesystem transport, by
contrast, let a worker read a half-written message (JSONDecodeError) on this kind of machine.

Why a subclass: a virtual transport sleeps ``polling_interval`` (default 1 s) whenever it cannot
take a message, including while the worker's prefetch window is full, so throughput is about
``concurrency / polling_interval`` tasks a second. The documented way to shorten it, the
``polling_interval`` transport option, crashes this transport: it hands every option it does
not know to ``sqlalchemy.create_engine()`` (TypeError). This channel keeps kombu's own options
away from the engine, and the transport polls every 0.1 s by default.

Importing this module points the ``sqla+`` and ``sqlalchemy+`` URL schemes at it;
:mod:`nodepool.celery` imports it, so every nodepool process uses it.
"""

from __future__ import annotations

from time import monotonic

from celery.worker import state as worker_state
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as kombu_sqla
from sqlalchemy import create_engine
from sqlalchemy.exc import IntegrityError, OperationalError

# Transport options that configure kombu itself and must not reach create_engine().
KOMBU_OPTIONS = frozenset(
    {
        "queue_tablename",
        "message_tablename",
        "callback",
        "errback",
        "max_retries",
        "interval_start",
        "interval_step",
        "interval_max",
        "retry_errors",
        "polling_interval",
    }
)


class Channel(kombu_sqla.Channel):
    def _engine_from_config(self):
        conninfo = self.connection.client
        engine_options = {k: v for k, v in conninfo.transport_options.items() if k not in KOMBU_OPTIONS}
        return create_engine(conninfo.hostname, **engine_options)

    def _open(self):
        """kombu's engine setup, safe across processes on a fresh broker file.

        kombu creates its tables with ``metadata.create_all()``, which checks for each table and
        then creates it: two processes starting together (``make run``: worker and beat) can both
        see no table and one dies on ``table kombu_message already exists``. The loser runs the
        check again, which now finds the tables the winner made.
        """
        for attempt in range(5):
            try:
                return super()._open()
            except OperationalError as exc:
                if "already exists" not in str(exc) or attempt == 4:
                    raise
        raise AssertionError("unreachable")

    def _get_or_create(self, queue):
        """kombu's get-or-create of the queue row, safe across processes.

        kombu guards the insert with a thread lock only, so two processes starting together on a
        fresh broker file (``make run`` starts the worker and beat at once) can both insert and
        one dies on ``UNIQUE constraint failed: kombu_queue.name``. The loser reads the winner's row.
        """
        try:
            return super()._get_or_create(queue)
        except IntegrityError:
            self.session.rollback()
            return self.session.query(self.queue_cls).filter(self.queue_cls.name == queue).one()


def _worker_stopping() -> bool:
    # Set by the Celery worker's SIGTERM/SIGINT/SIGQUIT handlers (celery.worker.state).
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


class Transport(kombu_sqla.Transport):
    Channel = Channel
    polling_interval = 0.1
    # How often a blocking drain looks up from the broker for a shutdown request, seconds.
    stop_check_interval = 0.25

    def drain_events(self, connection, timeout=None):
        """Wait for a message up to ``timeout`` seconds, but return at once when the worker is stopping.

        A transport without an event loop runs under Celery's blocking loop (``synloop``), which
        asks for events with a 2 s timeout and notices a warm shutdown only between two calls:
        with polling on top, the worker used to sit 3-4 s in its broker poll after SIGTERM.
        Raises ``socket.timeout`` when no message came, as kombu's transport does.
        """
        if timeout is None or timeout <= self.stop_check_interval:
            return super().drain_events(connection, timeout=timeout)
        deadline = monotonic() + timeout
        while not _worker_stopping():
            remaining = deadline - monotonic()
            if remaining <= 0:
                break
            try:
                return super().drain_events(connection, timeout=min(self.stop_check_interval, remaining))
            except TimeoutError:
                continue
        raise TimeoutError()


TRANSPORT_ALIASES["sqla"] = TRANSPORT_ALIASES["sqlalchemy"] = f"{__name__}:Transport"
