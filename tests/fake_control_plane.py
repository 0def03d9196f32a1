"""An in-memory control plane that speaks the node side of docs/api-contract.md.

Used through ``httpx.MockTransport(fake.handle)`` by the agent's and the simulator's tests, so
that they exercise real HTTP requests and answers without the Django server (which other
branches build). It keeps the contract's rules that the clients rely on: bootstrap tokens,
``Authorization: Node`` credentials with rotation overlap, incarnation and sequence checks,
instructions handed out once, fencing tokens on lease events.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import httpx

NODE_PATH = re.compile(r"^/api/v1/nodes/(?P<id>[^/]+)/(?P<rest>.+)$")
LEASE_EVENTS = re.compile(r"^/api/v1/node-leases/(?P<id>[^/]+)/events$")


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def problem(status: int, code: str, detail: str = "") -> httpx.Response:
    return httpx.Response(
        status,
        content=json.dumps({"status": status, "code": code, "detail": detail or code}),
        headers={"Content-Type": "application/problem+json"},
    )


@dataclass
class FakeNode:
    id: str
    pool: str
    enrollment: dict
    credentials: set = field(default_factory=set)
    incarnation: int = 1
    sequence: int = -1
    lifecycle: str = "pending"
    heartbeats: list = field(default_factory=list)
    verdicts: list = field(default_factory=list)
    stop_leases: list = field(default_factory=list)
    checkpoint_leases: list = field(default_factory=list)
    benchmark: dict | None = None
    rotate_hint: bool = False


@dataclass
class FakeLease:
    id: str
    node_id: str
    fencing_token: int
    command: list | None
    state: str = "granted"
    events: list = field(default_factory=list)


class FakeControlPlane:
    """Call :meth:`handle` from ``httpx.MockTransport``. Attributes are there for tests to read."""

    def __init__(
        self,
        *,
        tokens: dict[str, str] | None = None,
        heartbeat_interval: float = 10.0,
        credential_ttl: timedelta = timedelta(hours=24),
    ):
        self.tokens = dict(tokens or {"npb_good.secret": "general"})
        self.heartbeat_interval = heartbeat_interval
        self.credential_ttl = credential_ttl
        self.nodes: dict[str, FakeNode] = {}
        self.leases: dict[str, FakeLease] = {}
        self.benchmarks: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.unavailable = 0  # answer this many requests with 503
        self.down = False  # answer every request with 503 (partition of the server)
        self._tokens = itertools.count(1)

    # -- helpers for tests ---------------------------------------------------------------------
    def node_by_hostname(self, hostname: str) -> FakeNode:
        return next(n for n in self.nodes.values() if n.enrollment.get("hostname") == hostname)

    def grant_lease(self, node_id: str, command: list | None, *, fencing_token: int | None = None) -> FakeLease:
        lease = FakeLease(str(uuid.uuid4()), node_id, fencing_token or next(self._tokens), command)
        self.leases[lease.id] = lease
        return lease

    def request_benchmark(self, node_id: str) -> str:
        nonce = secrets.token_hex(8)
        self.nodes[node_id].benchmark = {"nonce": nonce, "deadline": _iso(_now() + timedelta(minutes=5))}
        self.benchmarks[nonce] = {"node_id": node_id, "result": None}
        return nonce

    def _new_credential(self, node: FakeNode) -> str:
        secret = f"npn_{secrets.token_hex(6)}.{secrets.token_urlsafe(16)}"
        node.credentials.add(secret)
        return secret

    def _auth(self, request: httpx.Request) -> FakeNode | None:
        header = request.headers.get("Authorization", "")
        kind, _, secret = header.partition(" ")
        if kind != "Node":
            return None
        return next((n for n in self.nodes.values() if secret in n.credentials), None)

    # -- the transport -------------------------------------------------------------------------
    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append((request.method, request.url.path))
        if self.down:
            return problem(503, "unavailable")
        if self.unavailable > 0:
            self.unavailable -= 1
            return problem(503, "unavailable")
        body = json.loads(request.content or b"{}")
        path = request.url.path
        if path == "/api/v1/node-enrollments" and request.method == "POST":
            return self.enroll(body)
        match = LEASE_EVENTS.match(path)
        if match:
            return self.lease_event(request, match["id"], body)
        match = NODE_PATH.match(path)
        if not match:
            return problem(404, "not_found")
        node = self._auth(request)
        if node is None:
            return problem(401, "not_authenticated")
        if node.id != match["id"]:
            return problem(403, "permission_denied")
        if node.lifecycle == "retired":
            return problem(410, "node_retired", "this node was retired")
        rest = match["rest"]
        if rest == "heartbeats":
            return self.heartbeat(node, body)
        if rest == "credentials/rotate":
            secret = self._new_credential(node)
            return httpx.Response(
                201,
                json={
                    "credential": secret,
                    "expires_at": _iso(_now() + self.credential_ttl),
                    "previous_valid_until": _iso(_now() + timedelta(minutes=5)),
                },
            )
        if rest.startswith("benchmarks/"):
            nonce = rest.split("/", 1)[1]
            if nonce not in self.benchmarks or self.benchmarks[nonce]["node_id"] != node.id:
                return problem(404, "not_found")
            self.benchmarks[nonce]["result"] = body
            return httpx.Response(200, json={"status": "completed"})
        return problem(404, "not_found")

    def enroll(self, body: dict) -> httpx.Response:
        pool = self.tokens.get(body.get("bootstrap_token", ""))
        if pool is None:
            return problem(401, "invalid_bootstrap_token")
        if "capability" not in body or "resources" not in body["capability"]:
            return problem(400, "invalid", "capability.resources is required")
        node = FakeNode(id=str(uuid.uuid4()), pool=pool, enrollment=body)
        self.nodes[node.id] = node
        secret = self._new_credential(node)
        return httpx.Response(
            201,
            json={
                "node_id": node.id,
                "incarnation": 1,
                "credential": secret,
                "credential_expires_at": _iso(_now() + self.credential_ttl),
                "lifecycle": "pending",
                "heartbeat_interval": self.heartbeat_interval,
            },
        )

    def heartbeat(self, node: FakeNode, body: dict) -> httpx.Response:
        incarnation, sequence = int(body["incarnation"]), int(body["sequence"])
        node.heartbeats.append(body)
        if incarnation < node.incarnation:
            code = "stale_incarnation"
        elif incarnation == node.incarnation and sequence == node.sequence:
            code = "duplicate_sequence"
        elif incarnation == node.incarnation and sequence < node.sequence:
            code = "stale_sequence"
        else:
            code = "applied"
            node.incarnation, node.sequence = incarnation, sequence
        node.verdicts.append(code)
        answer = {
            "applied": code == "applied",
            "code": code,
            "server_time": _iso(_now()),
            "next_heartbeat_in": self.heartbeat_interval,
            "liveness": "alive",
            "lifecycle": node.lifecycle,
            "desired_lifecycle": node.lifecycle,
            "instructions": {
                "stop_leases": [],
                "checkpoint_leases": [],
                "run_benchmark": None,
                "rotate_credential": False,
            },
        }
        if code != "applied":
            return httpx.Response(200, json=answer)
        instructions = answer["instructions"]
        instructions["stop_leases"], node.stop_leases = node.stop_leases, []
        instructions["checkpoint_leases"], node.checkpoint_leases = node.checkpoint_leases, []
        instructions["run_benchmark"], node.benchmark = node.benchmark, None
        instructions["rotate_credential"], node.rotate_hint = node.rotate_hint, False
        answer["leases"] = [
            {"lease_id": lease.id, "fencing_token": lease.fencing_token, "command": lease.command}
            for lease in self.leases.values()
            if lease.node_id == node.id and lease.state in ("granted", "active")
        ]
        return httpx.Response(200, json=answer)

    def lease_event(self, request: httpx.Request, lease_id: str, body: dict) -> httpx.Response:
        node = self._auth(request)
        if node is None:
            return problem(401, "not_authenticated")
        lease = self.leases.get(lease_id)
        if lease is None or lease.node_id != node.id:
            return problem(404, "not_found")
        if lease.state in ("released", "expired", "lost", "revoked"):
            return problem(410, "lease_ended")
        if int(body.get("fencing_token", -1)) != lease.fencing_token:
            return problem(409, "stale_fencing_token")
        lease.events.append(body)
        if body["state"] == "running":
            lease.state = "active"
        elif body["state"] in ("succeeded", "failed"):
            lease.state = "released"
        return httpx.Response(200, json={"id": lease.id, "state": lease.state, "workload_state": body["state"]})


def make_agent(fake: FakeControlPlane, tmp_path, *, token: str = "npb_good.secret", **config):
    """An :class:`agent.runner.Agent` wired to ``fake`` through ``httpx.MockTransport``."""
    import random

    from agent.client import NodeClient
    from agent.runner import Agent, AgentConfig

    clock = config.pop("clock", None)
    client = NodeClient("http://cp.test", transport=httpx.MockTransport(fake.handle))
    config.setdefault("work_dir", tmp_path / "work")
    config.setdefault("stop_grace", 2.0)
    cfg = AgentConfig(url="http://cp.test", state_path=tmp_path / "state.json", bootstrap_token=token, **config)
    kwargs = {"clock": clock} if clock else {}
    return Agent(cfg, client=client, rng=random.Random(7), **kwargs)


def wait_until(predicate, *, timeout: float = 10.0, step=None):
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
