"""The real control plane, in process, for the agent's and the simulator's tests.

:class:`ControlPlane` points httpx clients straight at nodepool's WSGI application through
``httpx.WSGITransport``. Every request runs the real middleware, authentication, throttles,
views and services, in the calling thread and on the test's own database connection, so the
``db`` fixture still rolls each test back. (A test whose client runs in another thread, such as
the agent's ``run()`` loop or the simulator's ``FleetThread``, needs
``@pytest.mark.django_db(transaction=True)``: that thread has its own connection.)

What the real app cannot produce on demand are transport faults: the server being unreachable,
a 503 from a proxy in front of it, a ``Retry-After``. :class:`WireTransport` adds only those,
on top of the real answers, and records every exchange so that tests can read what went over
the wire (the heartbeats a node sent and the verdicts it got back).

Typical use (h10's renewal tests, the agent's and the simulator's)::

    def test_something(db, tmp_path):
        cp = ControlPlane()                     # a pool "general" and a bootstrap token for it
        agent = cp.make_agent(tmp_path)         # agent.runner.Agent wired to the real app
        agent.start()
        agent.step()
        assert cp.verdicts(agent.state.node_id) == ["applied"]
        cp.admit(agent.state.node_id)           # the real admission pipeline (checks, benchmark)
        lease = cp.grant_lease(["sleep", "1"])  # the real placement service

The async simulator takes :meth:`ControlPlane.async_transport` (same app, same recording; the
app then runs in a worker thread, so those tests are transactional: see AsyncWireTransport).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from django.contrib.auth.models import Group, User
from django.test import TestCase
from django.utils import timezone

URL = "http://testserver"  # in Django's default ALLOWED_HOSTS for tests
_NODE_PATH = re.compile(r"^/api/v1/nodes/(?P<id>[^/]+)/(?P<rest>.+)$")


@dataclass
class Exchange:
    """One request and its answer as they crossed the wire (bodies parsed from JSON where they were)."""

    method: str
    path: str
    request: Any
    status: int
    body: Any

    @property
    def node_id(self) -> str | None:
        match = _NODE_PATH.match(self.path)
        return match["id"] if match else None

    @property
    def endpoint(self) -> str:
        """The path with the node id folded out: ``nodes/{id}/heartbeats`` → ``heartbeats``."""
        match = _NODE_PATH.match(self.path)
        return match["rest"] if match else self.path.removeprefix("/api/v1/")


def _json(content: bytes) -> Any:
    try:
        return json.loads(content) if content else None
    except ValueError:
        return None


def problem(status: int, code: str, *, headers: dict | None = None) -> httpx.Response:
    """A problem+json answer, as a proxy or an overloaded server in front of the app would send."""
    return httpx.Response(
        status,
        content=json.dumps({"status": status, "code": code, "detail": code}),
        headers={"Content-Type": "application/problem+json", **(headers or {})},
    )


class WireTransport(httpx.BaseTransport):
    """The real WSGI app, with recorded exchanges and the transport faults it cannot produce itself.

    Faults (set them between calls):
        ``down``: every request fails to connect (``httpx.ConnectError``): a partition or a crash.
        ``unavailable``: answer the next N requests with 503 before they reach the app.
        ``intercept``: ``callable(request) -> httpx.Response | None``; a response replaces the
        app's (a 429 with ``Retry-After``, say); ``None`` lets the request through.
    """

    def __init__(self, app=None):
        if app is None:
            from django.core.wsgi import get_wsgi_application

            app = get_wsgi_application()
        self.app = httpx.WSGITransport(app=app)
        self.exchanges: list[Exchange] = []
        self.down = False
        self.unavailable = 0
        self.intercept = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.read()
        if self.down:
            raise httpx.ConnectError("control plane unreachable (test fault)", request=request)
        response = None
        if self.unavailable > 0:
            self.unavailable -= 1
            response = problem(503, "unavailable")
        elif self.intercept is not None:
            response = self.intercept(request)
        if response is None:
            response = self._call_app(request)
        content = response.read()
        self.exchanges.append(
            Exchange(request.method, request.url.path, _json(request.content), response.status_code, _json(content))
        )
        return httpx.Response(response.status_code, headers=response.headers, content=content, request=request)

    def _call_app(self, request: httpx.Request) -> httpx.Response:
        # As django.test.Client does: the handler's request_started/finished signals would close
        # the database connection, which in the calling thread is the test's own (its transaction).
        from django.core import signals
        from django.db import close_old_connections

        signals.request_started.disconnect(close_old_connections)
        signals.request_finished.disconnect(close_old_connections)
        try:
            response = self.app.handle_request(request)
            response.read()
            return response
        finally:
            signals.request_started.connect(close_old_connections)
            signals.request_finished.connect(close_old_connections)


class AsyncWireTransport(httpx.AsyncBaseTransport):
    """:class:`WireTransport` for ``httpx.AsyncClient`` (the simulator).

    Django gives code under a running event loop its own database connection per task context
    and refuses ORM calls there, so the app runs in one dedicated worker thread (requests are
    served one at a time, in order, on that thread's connection). That connection is not the
    test's: tests that use it need ``@pytest.mark.django_db(transaction=True)``.
    """

    def __init__(self, wire: WireTransport):
        self.wire = wire
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="control-plane")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.wire.handle_request, request)

    def close_connections(self) -> None:
        """Close the worker thread's database connections (call when the test is done with it)."""
        from django.db import connections

        self.executor.submit(connections.close_all).result()
        self.executor.shutdown()


class ControlPlane:
    """Pools, bootstrap tokens and helpers around the real app (see the module docstring).

    Args:
        pools: ``{pool name: Pool field overrides}``; default one pool ``general``.
        heartbeat_interval: seconds, set on every pool (the agents' pace).

    Attributes: ``tokens`` (pool name → bootstrap token secret), ``token`` (the first pool's),
    ``wire`` (the :class:`WireTransport`; its fault switches), ``url``.
    """

    def __init__(self, pools: dict[str, dict] | None = None, *, heartbeat_interval: int = 10, max_uses: int = 1000):
        from tests.factories import PoolFactory
        from tests.fleet_support import make_token

        self.url = URL
        self.wire = WireTransport()
        self.pools = {}
        self.tokens = {}
        for name, fields in (pools or {"general": {}}).items():
            fields = {"heartbeat_interval": heartbeat_interval, "heartbeat_grace": 3 * heartbeat_interval, **fields}
            self.pools[name] = PoolFactory(name=name, **fields)
            self.tokens[name] = make_token(self.pools[name], max_uses=max_uses, ttl=24 * 3600)
        self.token = next(iter(self.tokens.values()))
        self._client_user = None
        self._workloads = 0
        self._async_transports: list[AsyncWireTransport] = []

    # -- transports and clients ----------------------------------------------------------------
    @property
    def transport(self) -> WireTransport:
        return self.wire

    def async_transport(self) -> AsyncWireTransport:
        """The app for ``httpx.AsyncClient``; see :class:`AsyncWireTransport` (transactional tests only)."""
        transport = AsyncWireTransport(self.wire)
        self._async_transports.append(transport)
        return transport

    def close(self) -> None:
        """Release what the async transports hold (their worker threads' database connections)."""
        for transport in self._async_transports:
            transport.close_connections()
        self._async_transports.clear()

    def node_client(self):
        """An :class:`agent.client.NodeClient` on the real app."""
        from agent.client import NodeClient

        return NodeClient(self.url, transport=self.wire)

    def make_agent(self, tmp_path: Path, *, token: str | None = None, clock=None, **config):
        """An :class:`agent.runner.Agent` on the real app (state in ``tmp_path``, seeded jitter)."""
        from agent.runner import Agent, AgentConfig

        config.setdefault("work_dir", tmp_path / "work")
        config.setdefault("stop_grace", 2.0)
        cfg = AgentConfig(
            url=self.url, state_path=tmp_path / "state.json", bootstrap_token=self.token if token is None else token,
            **config,
        )  # fmt: skip
        kwargs = {"clock": clock} if clock else {}
        return Agent(cfg, client=self.node_client(), rng=random.Random(7), **kwargs)

    def make_simulator(self, **kwargs):
        """A :class:`simulator.FleetSimulator` on the real app; ``pools`` default to this plane's pools.

        Drive it with :class:`simulator.FleetThread` from the test's (synchronous) thread, so that the
        test can use the ORM between steps; needs ``django_db(transaction=True)``.
        """
        from simulator import FleetSimulator, PoolSpec

        kwargs.setdefault("pools", [PoolSpec(name, secret) for name, secret in self.tokens.items()])
        kwargs.setdefault("progress", False)
        kwargs.setdefault("seed", 1)
        return FleetSimulator(self.url, transport=self.async_transport(), **kwargs)

    # -- what went over the wire ---------------------------------------------------------------
    @property
    def exchanges(self) -> list[Exchange]:
        return self.wire.exchanges

    @property
    def requests(self) -> list[tuple[str, str]]:
        return [(e.method, e.path) for e in self.wire.exchanges]

    def sent(self, node_id, endpoint: str) -> list[Exchange]:
        """Exchanges of node ``node_id`` with ``/nodes/{id}/<endpoint>`` (e.g. ``"heartbeats"``)."""
        return [e for e in self.wire.exchanges if e.node_id == str(node_id) and e.endpoint == endpoint]

    def heartbeats(self, node_id) -> list[dict]:
        """The heartbeat bodies node ``node_id`` sent that reached the app, in order."""
        return [e.request for e in self.sent(node_id, "heartbeats") if e.status != 503]

    def verdicts(self, node_id) -> list[str]:
        """The app's verdict on each heartbeat (``applied``, ``duplicate_sequence``…; ``http_401``…)."""
        return [
            e.body["code"] if e.status == 200 else f"http_{e.status}"
            for e in self.sent(node_id, "heartbeats")
            if e.status != 503
        ]

    def lease_events(self, lease) -> list[dict]:
        """The lease event bodies the node sent for ``lease`` that reached the app (any answer)."""
        path = f"/api/v1/node-leases/{getattr(lease, 'pk', lease)}/events"
        return [e.request for e in self.wire.exchanges if e.path == path and e.status != 503]

    def lease_event_answers(self, lease) -> list[tuple[int, str]]:
        """``(status, code or state)`` the app answered to each of those events."""
        path = f"/api/v1/node-leases/{getattr(lease, 'pk', lease)}/events"
        return [
            (e.status, (e.body or {}).get("code") or (e.body or {}).get("state", ""))
            for e in self.wire.exchanges
            if e.path == path and e.status != 503
        ]

    # -- the database's view -------------------------------------------------------------------
    def node(self, node_id):
        from fleet.models import Node

        return Node.objects.select_related("pool").get(pk=node_id)

    def nodes(self):
        from fleet.models import Node

        return Node.objects.select_related("pool").order_by("hostname")

    def node_by_hostname(self, hostname: str):
        from fleet.models import Node

        return Node.objects.select_related("pool").get(hostname=hostname)

    # -- operator actions through the real services --------------------------------------------
    def admit(self, node_id) -> str:
        """Admit a pending node: the operator's ``admit`` and the admission task it queues.

        Returns the node's lifecycle afterwards (``ready``, or ``admitting`` while a benchmark is due).
        """
        from fleet.events import Actor
        from fleet.services import node_admit

        node = self.node(node_id)
        with TestCase.captureOnCommitCallbacks(execute=True):
            node_admit(node_id=node.pk, expected_version=node.version, actor=Actor.system("test:operator"))
        return self.node(node_id).lifecycle

    def client_user(self) -> User:
        """A user in the ``clients`` group (who asks for leases)."""
        from nodepool.api.permissions import CLIENTS

        if self._client_user is None:
            self._client_user, _ = User.objects.get_or_create(username="cp-client")
            self._client_user.groups.add(Group.objects.get_or_create(name=CLIENTS)[0])
        return self._client_user

    def grant_lease(
        self, command: list | None, *, workload_id: str = "", pool: str | None = None, cpu: str = "100m", **extra
    ):
        """Ask for a lease through the real placement service; returns the granted ``Lease``."""
        from tests.support import grant

        self._workloads += 1
        return grant(
            self.client_user(), workload_id or f"job-{self._workloads}", pool=pool or next(iter(self.pools)),
            cpu=cpu, command=command, **extra,
        )  # fmt: skip

    def revoke_lease(self, lease) -> bool:
        """Revoke a live lease: its fencing token becomes stale and the node is told to stop it."""
        from fleet.events import Actor
        from leases.reconcile import revoke_lease

        return revoke_lease(lease, actor=Actor.system("test:operator"), reason="revoked by a test")

    def request_checkpoint(self, lease) -> int:
        from fleet.events import Actor
        from leases.fencing import request_checkpoint

        return request_checkpoint(lease=lease, actor=Actor.system("test:operator"))

    def quarantine(self, node_id, reason: str = "incident response"):
        from fleet.events import Actor
        from maintenance.services import quarantine_node

        return quarantine_node(node_id=node_id, reason=reason, evidence={}, actor=Actor.system("test:operator"))

    def retire(self, node_id, *, force: bool = True):
        from fleet.events import Actor
        from maintenance.services import retire_node

        node = self.node(node_id)
        return retire_node(
            node_id=node_id, expected_version=node.version, reason="retired by a test", force=force,
            actor=Actor.system("test:operator"),
        )  # fmt: skip


def wait_until(predicate, *, timeout: float = 10.0, step=None) -> bool:
    """Poll ``predicate`` (calling ``step`` between polls) until true; for real subprocesses only."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if step:
            step()
        if predicate():
            return True
        time.sleep(0.02)
    return False


def later(**delta) -> Any:
    """``timezone.now() + timedelta(**delta)``, for ``time_machine.travel``."""
    return timezone.now() + timedelta(**delta)
