"""``nodepoolctl lease request|renew|release``: what a scheduler does, from the command line."""

from __future__ import annotations

import json

import click

from .choices import RELEASE_OUTCOMES
from .client import ApiError
from .render import dump


@click.group()
def lease():
    """Request, renew and release leases (placement of work on nodes)."""


def _resources(cpu, memory, gpu, extra) -> dict:
    resources = {"cpu": cpu, "memory": memory, "nvidia.com/gpu": gpu}
    for item in extra:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise click.BadParameter(f"{item!r}: expected name=quantity", param_hint="--resource")
        resources[name] = value
    return {k: v for k, v in resources.items() if v}


@lease.command("request")
@click.option("--workload", "workload_id", required=True, help="Workload id (the fencing token sequence's key).")
@click.option("--pool", required=True)
@click.option("--cpu", default=None, help='Quantity, e.g. "500m" or "2".')
@click.option("--memory", default=None, help='Quantity, e.g. "4Gi".')
@click.option("--gpu", default=None, help="nvidia.com/gpu count.")
@click.option("--resource", "extra", multiple=True, help="Any other resource: name=quantity (repeatable).")
@click.option("--shape", default=None, help="A named shape instead of resources.")
@click.option("--ttl", "ttl_seconds", type=int, default=600, show_default=True, help="Seconds.")
@click.option("--queue", is_flag=True, help="Wait in the queue when nothing fits now (202).")
@click.option("--idempotency-key", default=None, help="Same key, same lease: safe to retry.")
@click.option("--command", "argv", default=None, help="A JSON array: what the node's agent runs.")
@click.option("-o", "--output", type=click.Choice(["json", "yaml"]), default=None)
@click.pass_obj
def lease_request(obj, workload_id, pool, cpu, memory, gpu, extra, shape, ttl_seconds, queue, idempotency_key, argv,
                  output):  # fmt: skip
    """Place a workload: prints the lease (node and fencing token), or why nothing fits."""
    body = {"workload_id": workload_id, "pool": pool, "ttl_seconds": ttl_seconds, "queue": queue}
    resources = _resources(cpu, memory, gpu, extra)
    if shape:
        body["shape"] = shape
    if resources:
        body["resources"] = resources
    if argv:
        try:
            body["command"] = json.loads(argv)
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--command") from None
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    response = obj.api.post("/node-leases", body, headers=headers)
    data = response.json()
    if output:
        click.echo(dump(data, output))
    elif response.status_code == 202:
        click.echo(f"lease-request/{data.get('lease_request')} queued: {data.get('reasons')}")
    else:
        click.echo(
            f"lease/{data['id']} granted on node {data.get('node_id')} with fencing token {data.get('fencing_token')}"
        )


def _fence(obj, lease_id: str) -> dict:
    current = obj.api.get(f"/node-leases/{lease_id}")
    return {"fencing_token": current["fencing_token"], "node_incarnation": current["node_incarnation"]}


@lease.command("renew")
@click.argument("lease_id")
@click.option("--ttl", "ttl_seconds", type=int, default=None, help="New TTL in seconds (default: the lease's own).")
@click.pass_obj
def lease_renew(obj, lease_id, ttl_seconds):
    """Extend LEASE_ID (with its current fencing token and node incarnation)."""
    body = {**_fence(obj, lease_id), **({"ttl_seconds": ttl_seconds} if ttl_seconds else {})}
    data = obj.api.post(f"/node-leases/{lease_id}/renew", body).json()
    click.echo(f"lease/{lease_id} renewed until {data.get('expires_at')}")


@lease.command("release")
@click.argument("lease_id")
@click.option("--outcome", type=click.Choice(RELEASE_OUTCOMES), default="succeeded", show_default=True)
@click.pass_obj
def lease_release(obj, lease_id, outcome):
    """End LEASE_ID and give its capacity back."""
    try:
        obj.api.post(f"/node-leases/{lease_id}/release", {**_fence(obj, lease_id), "outcome": outcome})
    except ApiError:
        raise
    click.echo(f"lease/{lease_id} released ({outcome})")
