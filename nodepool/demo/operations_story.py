"""The demo's pool-operation steps: a rolling upgrade with a canary, and a scale-up for demand.

Each uses a small pool of its own (so the rest of the story's fleet is undisturbed) and checks
everything through the public API: the dry run, the upgrade's progress and events, the nodes'
versions, the autoscaler's decisions and the new machine's scale-up time.
"""

from __future__ import annotations

import time

from humanunits import quantity
from operations.models import ProviderMachine
from operations.providers import SimulatedProvider
from simulator import FleetSimulator, FleetThread, PoolSpec

from .client import poll

ROLLOUT_NODES = 6
FAST = {"heartbeat_interval": 2, "heartbeat_grace": 10, "loss_threshold": 60}
TEMPLATE = {"resources": {"cpu": "2", "memory": "4Gi"}, "labels": {"zone": "zone-a"}}


def _pool(api, name: str, description: str) -> dict:
    response = api.raw("GET", f"/pools/{name}")
    if response.status_code == 200:
        return response.json()
    body = {"name": name, "kind": "standard", "description": description, "admission_mode": "automatic",
            "trust_node_labels": True, "labels": {"demo": "true"}, **FAST}  # fmt: skip
    return api.post("/pools", body)


def _ready(api, pool: str) -> list[dict]:
    return [n for n in api.all("/nodes", pool=pool) if n["lifecycle"] == "ready" and n["liveness"] == "alive"]


def step_upgrade(story) -> list[str]:
    """Six simulated nodes in pool ``rollout`` go from 1.0.0 to 2.0.0, canary first, two at a time."""
    api = story.api
    _pool(api, "rollout", "demo: nodes for the rolling upgrade")
    token = api.post("/bootstrap-tokens", {"pool": "rollout", "max_uses": ROLLOUT_NODES, "ttl_seconds": 3600})["token"]
    sim = FleetSimulator(api.base_url, pools=[PoolSpec("rollout", token)], seed=42, progress=False, max_backoff=5.0)
    fleet = FleetThread(sim).open()
    fleet.sim = sim
    story.extra_fleets.append(fleet)
    fleet.enroll(ROLLOUT_NODES)
    fleet.start()
    poll(lambda: len(_ready(api, "rollout")), lambda n: n == ROLLOUT_NODES, timeout=story.timeout,
         what="the rollout pool's nodes admitted")  # fmt: skip
    body = {
        "pool": "rollout", "max_unavailable_nodes": "2", "canary_nodes": 1, "soak_seconds": 5, "node_timeout": 120,
        "target": {"version": "2.0.0", "action": "agent",
                   "artifact": {"ref": "https://artifacts.example/nodepool-agent-2.0.0.tar.gz", "sha256": "c" * 64}},
        "reason": "demo: agent 2.0.0",
    }  # fmt: skip
    plan = api.post("/upgrades/dry-run", body)
    upgrade = api.post("/upgrades", body)
    api.post(f"/upgrades/{upgrade['id']}/start", {"expected_version": upgrade["version"]})
    peak, started = 0, time.monotonic()

    def progress():
        nonlocal peak
        nodes = api.all("/nodes", pool="rollout")
        out = [n for n in nodes if n["lifecycle"] != "ready" or n.get("cordoned") or n["liveness"] != "alive"]
        peak = max(peak, len(out))
        return api.get(f"/upgrades/{upgrade['id']}")

    done = poll(progress, lambda u: u["state"] in ("completed", "rolled_back", "failed", "paused"),
                timeout=story.timeout * 3, what="the upgrade to finish", interval=0.5)  # fmt: skip
    versions = sorted({n["agent_version"] for n in api.all("/nodes", pool="rollout")})
    story.check(done["state"] == "completed", f"the upgrade ended {done['state']}: {done['status_reason']}")
    story.check(versions == ["2.0.0"], f"versions after the roll: {versions}")
    story.check(peak <= 2, f"{peak} nodes out of service at once (max_unavailable_nodes 2)")
    order = ", ".join(f"{item['phase'][0]}:{item['name'][-4:]}" for item in plan["order"])
    return [
        f"dry run: order {order}; capacity cpu {quantity('cpu', plan['current_capacity'].get('cpu', 0))} now, "
        f"at least cpu {quantity('cpu', plan['predicted_minimum_capacity'].get('cpu', 0))} during the roll "
        f"({plan['waves']} waves)",
        "canary 1 node, soak 5 s, then 2 at a time: cordoned by system:upgrade, drained, told to upgrade, "
        "restarted, admitted at the target",
        f"completed in {time.monotonic() - started:.0f} s; at most {peak} node(s) out at once; versions now {versions}",
    ]


def step_scale_up(story) -> list[str]:
    """Pool ``elastic`` starts empty with min_nodes 1; a request that needs a second node brings one."""
    api = story.api
    _pool(api, "elastic", "demo: nodes the simulated provider creates on demand")
    current = api.get("/pools/elastic/operations")
    settings = {"provider": "simulated", "provider_url": api.base_url, "min_nodes": 1, "max_nodes": 3,
                "node_template": TEMPLATE, "scale_up_delay": 0, "scale_up_cooldown": 5, "scale_down_after": 60,
                "drain_policy": "checkpoint", "boot_timeout": 120}  # fmt: skip
    api.request("PATCH", "/pools/elastic/operations", json=settings, headers={"If-Match": f'"{current["version"]}"'})
    first = poll(lambda: len(_ready(api, "elastic")), lambda n: n >= 1, timeout=story.timeout,
                 what="the min_nodes machine to enroll and be admitted", interval=1)  # fmt: skip
    requested = time.monotonic()
    leases = []
    for n in range(2):
        body = {"workload_id": story.workload(f"render-{n}"), "pool": "elastic", "queue": True, "ttl_seconds": 3600,
                "resources": {"cpu": "1500m", "memory": "1Gi"}, "command": ["sleep", "3600"]}  # fmt: skip
        leases.append(api.post("/node-leases", body))
    queued = [item for item in leases if item.get("state") == "pending"]
    story.check(len(queued) == 1, f"{len(queued)} request(s) queued; one should wait for a new node")
    placed = poll(lambda: api.get(f"/lease-requests/{queued[0]['lease_request']}"), lambda r: r["state"] == "placed",
                  timeout=story.timeout, what="the queued request placed on a new node")  # fmt: skip
    waited = time.monotonic() - requested
    decisions = api.get("/scale-decisions", pool="elastic")["results"]
    machines = api.get("/machines", pool="elastic")["results"]
    story.check(any(d["direction"] == "up" and d["outcome"] == "succeeded" for d in decisions), "no scale-up decision")
    times = [m["scale_up_seconds"] for m in machines if m["scale_up_seconds"] is not None]
    return [
        f"min_nodes 1: the simulated provider started a machine; it enrolled with a single-use token "
        f"({first} node ready)",
        f"two requests of 1.5 CPU on 2-CPU nodes: one placed, one queued ({queued[0]['message'][:60]}…)",
        *(
            f"decision: {d['reason']}"
            for d in reversed(decisions)
            if d["direction"] == "up" and d["outcome"] == "succeeded"
        ),
        f"the queued request was placed on lease {placed['lease_id']} after {waited:.0f} s; "
        f"scale-up times (pending → ready): {', '.join(f'{t:.1f} s' for t in times)}",
    ]


def stop_extra(story) -> None:
    """Stop the steps' own fleets and the provider's simulator machines (they run in their own sessions)."""
    for fleet in story.extra_fleets:
        fleet.close()
    story.extra_fleets.clear()
    for machine in ProviderMachine.objects.exclude(provider_data={}):
        SimulatedProvider(url="").delete(machine.name, machine.provider_data)
