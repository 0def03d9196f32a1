"""The story an operator would recognise, each step checked against the real API over HTTP.

Every step returns a :class:`StepResult`; a step that raises counts as FAIL with the reason.
Waits poll the API for the expected state with a timeout (no fixed sleeps), so the story holds on
a loaded machine; the timeouts are generous multiples of the pools' liveness timings.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from humanunits import quantity

from . import operations_story
from .client import Api, poll

SLEEP_FOREVER = ["sleep", "3600"]  # simulated nodes report leases that carry a command
SMALL = {"cpu": "500m", "memory": "512Mi"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@dataclass
class StepResult:
    name: str
    ok: bool
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Story:
    """Holds the API client, the simulated fleet and what the steps learned.

    Args:
        api: the operator's client.
        fleet: a running ``simulator.FleetThread``.
        bad: names of the simulated nodes that were made to misbehave at enrollment
            (``{"underperform": name, "impossible": name}``).
        this_machine: the hostname the real agent enrolled with.
        timeout: the longest wait of a step for an expected state, seconds.
        say: where progress lines go.
    """

    def __init__(self, api: Api, fleet, *, bad: dict[str, str], this_machine: str, timeout: float, say: Callable):
        self.api = api
        self.fleet = fleet
        self.bad = bad
        self.this_machine = this_machine
        self.timeout = timeout
        self.say = say
        self.results: list[StepResult] = []
        self.busy: set[str] = set()  # nodes holding a lease of the story: each fault gets its own node
        self._ids = itertools.count(1)
        self.run_tag = time.strftime("%H%M%S")
        self.extra_fleets: list = []  # small fleets of the pool-operation steps (nodepool.demo.operations_story)

    # -- running -------------------------------------------------------------------------------
    def run(self, steps: list[tuple[str, Callable[[], list[str]]]]) -> list[StepResult]:
        for name, step in steps:
            self.say(f"\n▶ {name}")
            started = time.monotonic()
            try:
                lines, ok = step(), True
            except Exception as exc:  # a failed step is reported, the story goes on
                lines, ok = [f"{type(exc).__name__}: {exc}"], False
            result = StepResult(name, ok, lines, time.monotonic() - started)
            for line in lines:
                self.say(f"    {line}")
            self.say(f"  {'PASS' if ok else 'FAIL'} ({result.seconds:.0f} s)")
            self.results.append(result)
        return self.results

    def all(self) -> list[tuple[str, Callable[[], list[str]]]]:
        return [
            ("This machine joins through the real agent", self.step_this_machine),
            ("Admission: a contributor's node misreports its hardware", self.step_admission),
            ("Taints: GPU work lands on the GPU pool only with a toleration", self.step_taints),
            ("Spread: three replicas over three zones", self.step_spread),
            ("An unplaceable request and its explanation", self.step_unplaceable),
            ("A partitioned node: lost, its lease re-placed with a newer fencing token", self.step_partition),
            ("A restarted node: incarnation bump, its unreported lease lost", self.step_restart),
            ("A drain with a deadline ends in maintenance", self.step_drain),
            ("A quarantine: credentials and leases revoked", self.step_quarantine),
            ("A rolling upgrade: canary, then two at a time, admission verifies the target",
             lambda: operations_story.step_upgrade(self)),
            ("Autoscaling: pending demand brings a new machine from the provider",
             lambda: operations_story.step_scale_up(self)),
        ]  # fmt: skip

    # -- helpers -------------------------------------------------------------------------------
    def check(self, condition: bool, message: str) -> None:
        if not condition:
            raise AssertionError(message)

    def workload(self, prefix: str) -> str:
        return f"demo-{self.run_tag}-{prefix}-{next(self._ids)}"

    def lease(self, workload_id: str, pool: str = "general", *, resources=None, **extra) -> dict:
        body = {
            "workload_id": workload_id, "pool": pool, "resources": resources or SMALL,
            "ttl_seconds": 3600, "command": SLEEP_FOREVER, **extra,
        }  # fmt: skip
        lease = self.api.post("/node-leases", body)
        self.busy.add(lease["node_id"])
        return lease

    def wait_lease(self, lease_id: str, states: set[str], what: str) -> dict:
        return poll(lambda: self.api.lease(lease_id), lambda le: le["state"] in states, timeout=self.timeout, what=what)

    def wait_node(self, node_id: str, check: Callable[[dict], bool], what: str) -> dict:
        return poll(lambda: self.api.node(node_id), check, timeout=self.timeout, what=what)

    def sim_name(self, node_id: str) -> str:
        for node in self.fleet.sim.nodes.values():
            if node.node_id == node_id:
                return node.name
        raise AssertionError(f"node {node_id} is not a simulated node")

    def running_lease_on_sim_node(self, label: str) -> tuple[dict, str]:
        """A lease (with a command) on a simulated general node holding no other lease of the story,
        once the node reports it running. Returns the lease and the node's simulator name."""
        term = {"key": "nodepool.dev/node-id", "operator": "NotIn", "values": sorted(self.busy)}
        affinity = {"required": [term]} if self.busy else {}
        lease = self.lease(self.workload(label), node_selector={"simulated": "true"}, affinity=affinity)
        name = self.sim_name(lease["node_id"])
        lease = self.wait_lease(lease["id"], {"active"}, f"the simulated node {name} to report its lease running")
        return lease, name

    @staticmethod
    def zone(node: dict) -> str:
        return node["labels"].get("zone") or node["node_labels"].get("zone", "?")

    # -- steps ---------------------------------------------------------------------------------
    def step_this_machine(self) -> list[str]:
        page = poll(
            lambda: self.api.get("/nodes", hostname=self.this_machine),
            lambda p: any(n["lifecycle"] == "ready" and n["liveness"] == "alive" for n in p["results"]),
            timeout=self.timeout,
            what=f"{self.this_machine} to be admitted (ready) and alive",
        )
        node = next(n for n in page["results"] if n["lifecycle"] == "ready")
        cpu = node["capacity"].get("cpu", {}).get("capacity", 0)
        memory = node["capacity"].get("memory", {}).get("capacity", 0)
        lease = self.lease(
            self.workload("local"),
            resources={"cpu": "100m", "memory": "64Mi"},
            node_selector={"kubernetes.io/hostname": self.this_machine},
            command=["sleep", "600"],
        )
        self.check(lease["node_id"] == node["id"], "the pinned lease landed elsewhere")
        lease = self.wait_lease(lease["id"], {"active"}, "the agent to start the workload and report it running")
        return [
            f"{self.this_machine}: node {node['id']} in pool {node['pool']}, {node['lifecycle']}/{node['liveness']}, "
            f"incarnation {node['incarnation']}, agent {node['agent_version']}",
            f"verified capacity: cpu {quantity('cpu', cpu)}, memory {quantity('memory', memory)}",
            f"lease {lease['id']} (fencing token {lease['fencing_token']}): `sleep 600` runs here as a real "
            f"subprocess, reported {lease['state']}",
        ]

    def step_admission(self) -> list[str]:
        lines = []
        for fault, expect in (("underperform", "benchmark"), ("impossible", "plausib")):
            name = self.bad[fault]
            sim_node = self.fleet.sim.nodes[name]
            if not sim_node.node_id:  # refused at the door: that is a rejection too
                self.check(bool(sim_node.enroll_error), f"{name} neither enrolled nor refused")
                lines.append(f"{name} ({fault}): enrollment refused: {sim_node.enroll_error}")
                continue
            node = self.wait_node(
                sim_node.node_id,
                lambda n: n["lifecycle"] in ("rejected", "quarantined"),
                f"{name} ({fault}) to be rejected at admission",
            )
            reason = node["lifecycle_reason"]
            self.check(expect in reason.lower(), f"{name}: unexpected reason {reason!r}")
            lines.append(f"{name} in {node['pool']} ({fault}) → {node['lifecycle']}: {reason}")
        return lines

    def step_taints(self) -> list[str]:
        gpu = {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"}
        lease = self.lease(self.workload("train"), "gpu", resources=gpu, tolerations=[GPU_TOLERATION])
        node = self.api.node(lease["node_id"])
        self.check(node["pool"] == "gpu", f"the GPU lease landed in {node['pool']}")
        refused = self.api.raw(
            "POST",
            "/node-leases",
            json={"workload_id": self.workload("train"), "pool": "gpu", "resources": gpu, "command": SLEEP_FOREVER},
        )
        body = refused.json()
        self.check(refused.status_code == 409, f"without a toleration: {refused.status_code} {body.get('code')}")
        self.check("untolerated_taint" in body.get("reasons", {}), f"reasons: {body.get('reasons')}")
        accelerators = node["capability"]["verified"].get("accelerators") or [{}]
        model = accelerators[0].get("model", "GPU")
        return [
            f"with a toleration → 201 on {node['hostname']} (pool gpu, {model}), token {lease['fencing_token']}",
            f"without one → {refused.status_code} {body['code']}: {body['detail']}",
        ]

    def step_spread(self) -> list[str]:
        group = self.workload("web")
        zones = []
        for _ in range(3):
            lease = self.lease(
                self.workload("web"),
                node_selector={"simulated": "true"},
                spread={"group": group, "topology_key": "zone", "mode": "anti-affinity"},
            )
            node = self.api.node(lease["node_id"])
            zones.append((node["hostname"], self.zone(node)))
        self.check(len({z for _, z in zones}) == 3, f"replicas share a zone: {zones}")
        return [f"replica {i + 1} → {host} in {zone}" for i, (host, zone) in enumerate(zones)]

    def step_unplaceable(self) -> list[str]:
        response = self.api.raw(
            "POST",
            "/node-leases",
            json={
                "workload_id": self.workload("huge"),
                "pool": "general",
                "resources": {"cpu": "256", "memory": "2Ti"},
            },
        )
        body = response.json()
        status = response.status_code
        self.check(status == 409 and body.get("code") == "unschedulable", f"{status} {body}")
        self.check(body["reasons"].get("insufficient_cpu", 0) > 0, f"reasons: {body['reasons']}")
        self.check(body.get("cause") == "too_large", f"cause {body.get('cause')}: no node is that large")
        return [
            f"256 CPU, 2 TiB in general → {response.status_code} {body['code']} (cause: {body.get('cause')})",
            f"“{body['detail']}”",
        ]

    def step_partition(self) -> list[str]:
        lease, name = self.running_lease_on_sim_node("batch")
        node_id = lease["node_id"]
        self.fleet.partition(name)
        seen: list[str] = []

        def liveness():
            node = self.api.node(node_id)
            if not seen or seen[-1] != node["liveness"]:
                seen.append(node["liveness"])
            return node

        poll(liveness, lambda n: n["liveness"] == "lost", timeout=self.timeout * 2, what=f"{name} to be declared lost")
        lost = self.wait_lease(lease["id"], {"lost"}, "the partitioned node's lease to be lost")
        self.check("unreachable" in seen, f"liveness went {' → '.join(seen)} without unreachable")
        again = self.lease(lease["workload_id"], node_selector={"simulated": "true"})
        self.check(again["fencing_token"] > lease["fencing_token"], "the new lease's fencing token is not newer")
        self.check(again["node_id"] != node_id, "re-placed on the lost node")
        old = {"workload_id": lease["workload_id"], "fencing_token": lease["fencing_token"]}
        stale = self.api.post("/fencing/validate", old)
        self.check(stale["valid"] is False, "the old fencing token still validates")
        self.fleet.heal(name)
        return [
            f"{name} silenced; liveness seen: {' → '.join(seen)}",
            f"lease {lease['workload_id']}: {lost['state']} (token {lease['fencing_token']})",
            f"re-placed on {self.api.node(again['node_id'])['hostname']} with fencing token {again['fencing_token']}; "
            f"token {lease['fencing_token']} now fails /fencing/validate (current {stale['current_token']})",
            f"{name} healed: it comes back alive, its old work is fenced",
        ]

    def step_restart(self) -> list[str]:
        lease, name = self.running_lease_on_sim_node("svc")
        before = self.api.node(lease["node_id"])
        self.fleet.restart(name)
        after = self.wait_node(
            lease["node_id"],
            lambda n: n["incarnation"] > before["incarnation"],
            f"{name}'s new incarnation to be seen",
        )
        lost = self.wait_lease(lease["id"], {"lost"}, "the restarted node's unreported lease to be lost")
        return [
            f"{name} restarted: incarnation {before['incarnation']} → {after['incarnation']}, "
            f"restart count {after['restart_count']}, still {after['lifecycle']}/{after['liveness']}",
            f"lease {lease['workload_id']} (not reported by the new incarnation) → {lost['state']}",
        ]

    def step_drain(self) -> list[str]:
        lease, name = self.running_lease_on_sim_node("etl")
        node = self.api.node(lease["node_id"])
        # An operator action names the version it read: If-Match with the ETag of the GET (RFC 9110).
        drain = self.api.post(
            f"/nodes/{node['id']}/drain",
            {"reason": "firmware update", "policy": "wait", "deadline_in": 10},
            headers={"If-Match": self.api.etag(f"/nodes/{node['id']}")},
        )
        done = self.wait_node(node["id"], lambda n: n["lifecycle"] == "maintenance", f"{name} to reach maintenance")
        record = self.api.get(f"/drains/{drain['id']}")
        ended = self.api.lease(lease["id"])
        self.check(record["state"] == "forced", f"drain state {record['state']}")
        self.check(ended["state"] == "revoked", f"the lease is {ended['state']}")
        return [
            f"drain of {name} (policy wait, deadline in 10 s) while {lease['workload_id']} runs there",
            f"deadline passed → drain {record['state']}, lease {ended['state']}, node {done['lifecycle']}",
        ]

    def step_quarantine(self) -> list[str]:
        lease, name = self.running_lease_on_sim_node("mine")
        node = self.api.node(lease["node_id"])
        self.api.post(
            f"/nodes/{node['id']}/quarantine",
            {"reason": "demo: outbound traffic to a mining pool", "evidence": {"dst": "203.0.113.7:3333"}},
            headers={"If-Match": self.api.etag(f"/nodes/{node['id']}")},
        )
        node = self.api.node(node["id"])
        revoked = self.api.lease(lease["id"])
        live_credentials = [c for c in node["credentials"] if not c.get("revoked_at")]
        self.check(node["lifecycle"] == "quarantined", f"lifecycle {node['lifecycle']}")
        self.check(not live_credentials, f"{len(live_credentials)} credential(s) still valid")
        self.check(revoked["state"] == "revoked", f"the lease is {revoked['state']}")
        refused = poll(
            lambda: self.fleet.sim.nodes[name].counters.get("refused_authentication_failed", 0),
            lambda n: n > 0,
            timeout=self.timeout,
            what=f"{name}'s next heartbeat to be refused",
        )
        return [
            f"{name} quarantined: {node['lifecycle_reason']}",
            f"credentials: {len(node['credentials'])} revoked; lease {lease['workload_id']} → {revoked['state']}; "
            f"artifacts blocked: {node['artifacts_blocked']}",
            f"its heartbeats are now refused (401 × {refused})",
        ]
