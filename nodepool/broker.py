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

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as kombu_sqla
from sqlalchemy import create_engine
from sqlalchemy.exc import IntegrityError

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


class Transport(kombu_sqla.Transport):
    Channel = Channel
    polling_interval = 0.1


TRANSPORT_ALIASES["sqla"] = TRANSPORT_ALIASES["sqlalchemy"] = f"{__name__}:Transport"
