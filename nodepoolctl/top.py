"""``nodepoolctl top pool|node``: capacity in use, as ``kubectl top`` shows it (split from
nodepoolctl/cli.py, issue 28 step 8)."""

from __future__ import annotations

import click

from . import describe as describe_mod
from . import render
from .client import ApiError
from .render import console


@click.group()
def top():
    """Capacity in use (kubectl top)."""


@top.command("pool")
@click.option("-o", "--output", type=click.Choice(["json", "yaml"]), default=None)
@click.pass_obj
def top_pool(obj, output):
    """Per pool: nodes, schedulable nodes, cpu and memory allocated of allocatable, free GPUs.

    Reads each pool's capacity endpoint (``GET /pools/{name}/capacity``); a server without it
    (404 on the first pool) gets the same sums computed from the node list."""
    api = obj.api
    pools = [pool["name"] for pool in api.list("/pools")]
    try:
        rows = [describe_mod.pool_capacity_from_api(name, api.get(f"/pools/{name}/capacity")) for name in pools]
    except ApiError as exc:
        if exc.status != 404:
            raise
        rows = describe_mod.pool_capacity(api.list("/nodes"))
    if output:
        click.echo(render.dump(rows, output))
    else:
        render.print_whole(console(), describe_mod.top_table(rows))


@top.command("node")
@click.argument("name", required=False)
@click.option("-l", "--selector", default=None, help="Label selector, as `get nodes -l`.")
@click.option("--pool", default=None, help="Only this pool.")
@click.option("-o", "--output", type=click.Choice(["json", "yaml"]), default=None)
@click.pass_obj
def top_node(obj, name, selector, pool, output):
    """Per node: cpu and memory in use as its agent last reported them (and % of allocatable),
    allocated to leases (and %), free GPUs. ``<unknown>`` for a node that has not reported usage."""
    api = obj.api
    nodes = [api.node(name)] if name else api.list("/nodes", pool=pool, label=selector)
    if pool and not nodes:
        api.get(f"/pools/{pool}")  # an unknown pool is an error (404), not "No resources"
    rows = [describe_mod.node_usage(node) for node in nodes]
    if output:
        click.echo(render.dump(rows, output))
    elif not rows:
        click.echo("No resources found.", err=True)
    else:
        render.print_whole(console(), describe_mod.top_node_table(rows, width=render.fit_width()))
