"""The demo's environment: an operator with an API token, a marketplace owner, pools and tokens.

The users are made with the ORM (there is no API for accounts); pools and bootstrap tokens go
through the public API, as an operator would create them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from nodepool.api.permissions import OPERATORS, OWNERS
from nodepool.tokens import create_user_token

from .client import Api

OPERATOR = "demo-operator"
OWNER = "demo-contributor"

# Short liveness timings so the story runs in minutes: stale after two intervals, unreachable
# after the grace, lost (leases declared lost) after the loss threshold. The server stretches them
# only past NODEPOOL["MAX_HEARTBEATS_PER_SECOND"]. 10 s keeps 300 nodes at 30 renewals/s, which
# a loaded 2-core machine serves on SQLite alongside the worker, beat and the simulator itself.
TIMINGS = {"heartbeat_interval": 10, "heartbeat_grace": 20, "loss_threshold": 40}

POOLS = [
    {
        "name": "general",
        "kind": "standard",
        "description": "demo: general purpose CPU nodes",
        "admission_mode": "automatic",
        "trust_node_labels": True,
        "scheduling_policy": "binpack",
        "labels": {"demo": "true"},
        **TIMINGS,
    },
    {
        "name": "gpu",
        "kind": "standard",
        "description": "demo: GPU nodes, tainted so only GPU work lands",
        "admission_mode": "automatic",
        "trust_node_labels": True,
        "scheduling_policy": "binpack",
        "labels": {"demo": "true", "accelerator": "nvidia"},
        "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        **TIMINGS,
    },
    {
        "name": "marketplace",
        "kind": "marketplace",
        "description": "demo: contributed machines, benchmarked",
        "admission_mode": "automatic",
        "trust_node_labels": True,
        "scheduling_policy": "spread",
        "benchmark_required": True,
        "benchmark_tolerance": 0.8,
        "benchmark_timeout": 300,
        "labels": {"demo": "true"},
        **TIMINGS,
    },
]


@dataclass
class Operator:
    username: str
    password: str
    token: str
    # The marketplace contributor's admin login (the owner's view of their nodes, usage, statements).
    owner_username: str = OWNER
    owner_password: str = ""


def create_users() -> Operator:
    """The operator (superuser, in the operators group) with a fresh password and API token,
    and the marketplace contributor who owns the marketplace pool's nodes."""
    User = get_user_model()
    password = secrets.token_urlsafe(12)
    user, _ = User.objects.get_or_create(username=OPERATOR, defaults={"email": "operator@demo.invalid"})
    user.is_staff = user.is_superuser = True
    user.set_password(password)
    user.save()
    user.groups.add(Group.objects.get_or_create(name=OPERATORS)[0])
    _, token = create_user_token(user, replace=True)
    owner, _ = User.objects.get_or_create(username=OWNER, defaults={"email": "contributor@demo.invalid"})
    owner_password = secrets.token_urlsafe(12)
    owner.is_staff = True  # the admin's login; the owners group limits what they see there
    owner.set_password(owner_password)
    owner.save()
    owner.groups.add(Group.objects.get_or_create(name=OWNERS)[0])
    return Operator(OPERATOR, password, token, owner_username=OWNER, owner_password=owner_password)


# What the marketplace pays its contributors (per resource-hour; marketplace.pricing).
PRICES = [("cpu", "0.040000"), ("memory", "0.005000")]


def create_prices(api: Api) -> None:
    """Price the marketplace pool (a version from the epoch, so every demo lease is priced)."""
    for resource, price in PRICES:
        body = {
            "pool": "marketplace",
            "resource": resource,
            "unit_price": price,
            "currency": "EUR",
            "effective_from": "2020-01-01T00:00:00Z",
            "note": "make demo",
        }
        response = api.raw("POST", "/pool-prices", json=body)
        if response.status_code not in (201, 409):  # 409: priced by an earlier run
            raise RuntimeError(f"pricing the marketplace pool failed: {response.status_code} {response.text}")


def create_pools(api: Api) -> dict[str, dict]:
    """Create the demo pools (or keep the ones that exist). Returns name → pool."""
    pools = {}
    for body in POOLS:
        response = api.raw("GET", f"/pools/{body['name']}")
        pools[body["name"]] = response.json() if response.status_code == 200 else api.post("/pools", body)
    return pools


def create_tokens(api: Api, *, max_uses: int) -> dict[str, str]:
    """One bootstrap token per pool (the marketplace's names its owner). Returns pool → secret."""
    tokens = {}
    for body in POOLS:
        request = {"pool": body["name"], "max_uses": max_uses, "ttl_seconds": 86400, "description": "make demo"}
        if body["kind"] == "marketplace":
            request["owner"] = OWNER
        tokens[body["name"]] = api.post("/bootstrap-tokens", request)["token"]
    return tokens
