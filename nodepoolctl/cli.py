"""nodepoolctl's commands (Click + Rich). See docs/nodepoolctl.md.

Conventions, as kubectl's: ``get`` lists (``-o wide|json|yaml|name``, ``-l`` label selector),
``describe`` shows one object in sections with its events last, the actions (cordon, drain…) take
a reason. Every action sends the version of the node it acts on (``If-Match``): read just before
the action, or ``--expected-version N`` from an earlier ``get``; a 412 (the node changed
meanwhile) is retried once with a fresh read only with ``--force``. Any failure prints one line
(``error: <status> <code>: <detail>``) on stderr and exits 1; usage errors exit 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from . import describe as describe_mod
from . import render
from .choices import DRAIN_POLICIES
from .client import Api, ApiError
from .config import ConfigError, load_config
from .render import console
from .times import deadline_option, time_option

KIND_ALIASES = {
    "node": "node", "nodes": "node", "no": "node",
    "pool": "pool", "pools": "pool",
    "lease": "lease", "leases": "lease",
    "drain": "drain", "drains": "drain",
    "quarantine": "quarantine", "quarantines": "quarantine",
    "device": "device", "devices": "device",
    "event": "event", "events": "event", "ev": "event",
}  # fmt: skip
PATHS = {"node": "/nodes", "pool": "/pools", "lease": "/node-leases", "drain": "/drains", "quarantine": "/quarantines",
         "device": "/nodes/{node}/devices", "event": "/events"}  # fmt: skip
NODE_REFS = {"lease": "node_id", "quarantine": "node", "event": "node_id"}  # tables that name a node by its id
EVENTS_SHOWN = 50  # get events: the newest this many (--limit)
OUTPUTS = click.Choice(["wide", "json", "yaml", "name"])


NAME_LOOKUPS = 20  # up to this many distinct nodes are read one by one; more: the node list once


class Context:
    def __init__(self, url: str | None, token: str | None):
        self._url, self._token, self._api = url, token, None

    def node_names(self, ids: set[str]) -> dict[str, str]:
        """Node id → name (hostname) for ``ids``: each node read by id when there are few, else
        the whole node list once; a node the caller may not read keeps its id."""
        names: dict[str, str] = {}
        if len(ids) <= NAME_LOOKUPS:
            for node_id in ids:
                try:
                    names[node_id] = self.api.get(f"/nodes/{node_id}").get("hostname") or node_id
                except ApiError:
                    names[node_id] = node_id
            return names
        return {n["id"]: n.get("hostname") or n["id"] for n in self.api.iter("/nodes") if n["id"] in ids}

    @property
    def api(self) -> Api:
        if self._api is None:
            config = load_config(url=self._url, token=self._token)
            self._api = Api(config.url, config.token)
        return self._api


def _complete_nodes(ctx, param, incomplete: str):
    """Tab completion of node names (hostnames) from the API; nothing when it cannot be reached."""
    try:
        root = ctx.find_root().params
        config = load_config(url=root.get("url"), token=root.get("token"))
        api = Api(config.url, config.token, timeout=3)
        names = [n.get("hostname") for n in api.get("/nodes", page_size=500)["results"]]
    except (ApiError, ConfigError, KeyError, TypeError):
        return []
    return [click.shell_completion.CompletionItem(n) for n in names if n and n.startswith(incomplete)]


NODE = click.argument("node", metavar="NODE", shell_complete=_complete_nodes)
OPTIONAL_NODE = click.argument("node", metavar="[NODE]", required=False, shell_complete=_complete_nodes)


def BULK(command):
    """-l/--selector, --expect, --pool, --dry-run: act on many nodes by label selector."""
    for option in reversed([
        click.option("-l", "--selector", default=None,
                     help="Act on every node this label selector picks (instead of NODE); never empty."),
        click.option("--expect", "expect", type=click.IntRange(min=0), default=None,
                     help="With -l: how many nodes you expect it to pick; any other count changes nothing."),
        click.option("--pool", default=None, help="With -l: only nodes of this pool."),
    ]):  # fmt: skip
        command = option(command)
    return command


def _bulk(obj: Context, action: str, *, selector: str, expect, pool, dry_run: bool, body: dict) -> None:
    """``POST /nodes/bulk/<action>``: one line per node, a summary; rc 1 when a node was not acted on."""
    api = obj.api
    if expect is None:
        if not dry_run:
            raise click.UsageError("-l needs --expect N (how many nodes you mean); --dry-run shows the count")
        expect = len(api.list("/nodes", label=selector, pool=pool)) if selector.strip() else 0
    payload = {"selector": selector, "expected_count": expect, "dry_run": dry_run, **body}
    if pool:
        payload["pool"] = pool
    data = api.post(f"/nodes/bulk/{action}", payload).json()
    refused = 0
    for node in data.get("nodes") or []:
        outcome = node["outcome"].replace("_", " ")
        detail = f": {node['detail']}" if node.get("detail") else ""
        click.echo(f"node/{node.get('name') or node['node_id']} {outcome}{detail}")
        refused += node["outcome"] in ("blocked", "failed")
    counts = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted((data.get("counts") or {}).items()))
    click.echo(f"{data.get('matched', 0)} node(s) matched{' (dry run)' if dry_run else ''}: {counts or 'none'}")
    if refused:
        click.echo(f"error: {refused} of {data.get('matched')} node(s) not {action}ed", err=True)
        raise click.exceptions.Exit(1)


def _one_or_many(node, selector) -> None:
    if bool(node) == (selector is not None):
        raise click.UsageError("give a NODE or -l SELECTOR (exactly one)")


REASON = click.option("--reason", required=True, help="Why (recorded with the action).")
FORCE = click.option("--force", is_flag=True, help="On 412 (the node changed meanwhile): re-read it and retry once.")
EXPECTED = click.option(
    "--expected-version", type=int, default=None, help="Act only if the node is still at this version (from `get`)."
)


class Group(click.Group):
    """Turns API and config errors into one line on stderr and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (ApiError, ConfigError) as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", envvar="NODEPOOL_URL", help="Server base URL (env NODEPOOL_URL; config file `url`).")
@click.option("--token", envvar="NODEPOOL_TOKEN", help="API token (env NODEPOOL_TOKEN; config file `token`).")
@click.pass_context
def cli(ctx, url, token):
    """nodepoolctl: run a nodepool fleet from the command line (a client of the public API)."""
    ctx.obj = Context(url, token)
    ctx.call_on_close(lambda: ctx.obj._api.close() if ctx.obj._api else None)


def _kind(value: str) -> str:
    try:
        return KIND_ALIASES[value.lower()]
    except KeyError:
        raise click.BadParameter(f"one of {', '.join(sorted(set(KIND_ALIASES.values())))}") from None


def _show(kind: str, objects: list[dict], output: str | None, obj: Context | None = None) -> None:
    if output in ("json", "yaml"):
        click.echo(render.dump(objects, output))
    elif output == "name":
        click.echo(render.names(kind, objects))
    elif not objects:
        click.echo("No resources found.", err=True)
    else:
        if obj is not None and kind in NODE_REFS:  # tables name nodes by name, not by id
            key = NODE_REFS[kind]
            names = obj.node_names({str(o[key]) for o in objects if o.get(key)})
            objects = [{**o, render.NODE_NAME_KEY: names.get(str(o.get(key)), "")} for o in objects]
        width = None if output == "wide" else render.fit_width()
        render.print_whole(console(), render.table(kind, objects, wide=output == "wide", width=width))


@cli.command()
@click.argument("kind", metavar="KIND", shell_complete=lambda c, p, i: [k for k in PATHS if k.startswith(i)])
@click.argument("name", required=False)
@click.option("-o", "--output", type=OUTPUTS, default=None, help="wide, json, yaml or name (default: a table).")
@click.option(
    "-l",
    "--selector",
    default=None,
    help="Label selector (nodes), Kubernetes' grammar: k=v,k!=v,k in (a,b),k notin (a),k,!k,k>1,k<7.",
)
@click.option("--pool", default=None, help="Only this pool.")
@click.option("--node", "node_ref", default=None, help="Events: only this node's (name or id).")
@click.option("--limit", type=click.IntRange(1, 500), default=EVENTS_SHOWN, show_default=True,
              help="Events: the newest this many, shown oldest first.")  # fmt: skip
@click.pass_obj
def get(obj: Context, kind, name, output, selector, pool, node_ref, limit):
    """List nodes, pools, leases, drains, quarantines or events (or show one by NAME); devices of node NAME."""
    kind = _kind(kind)
    api = obj.api
    if kind == "event":  # the newest --limit events, oldest first (kubectl get events)
        if name and not node_ref:
            node_ref = name
        node_id = api.node(node_ref)["id"] if node_ref else None
        if pool:
            api.get(f"/pools/{pool}")  # an unknown pool is an error (404), not "No resources"
        page = api.get("/events", pool=pool, node=node_id, page_size=limit)
        events = sorted(page.get("results") or [], key=lambda e: e.get("created_at") or "")
        _show(kind, events, output, obj)
        return
    if kind == "device":  # the devices of one node: `get devices NODE`
        if not name:
            raise click.UsageError("get devices needs a NODE (name or id)")
        _show(kind, api.get(f"/nodes/{api.node(name)['id']}/devices", retired="false"), output)
        return
    if kind == "pool" and pool and not name:
        name = pool  # /pools has no ?pool= filter (the API refuses an unknown parameter): the pool itself
    if name:
        item = api.node(name) if kind == "node" else api.get(f"{PATHS[kind]}/{name}")
        objects = [item]
    else:
        if selector and kind != "node":
            raise click.UsageError("-l/--selector applies to nodes only")
        objects = api.list(PATHS[kind], pool=pool, label=selector)
        if pool and not objects:
            api.get(f"/pools/{pool}")  # an unknown pool is an error (404 pool_not_found, rc 1), not "No resources"
    _show(kind, objects, output, obj)


@cli.group()
def describe():
    """Show one object in detail (kubectl describe)."""


@describe.command("node")
@NODE
@click.pass_obj
def describe_node(obj: Context, node):
    """A node: state, conditions in order, capacity, holds, leases, events last."""
    found = obj.api.node(node)
    try:  # whether the pool trusts node labels (describe marks them untrusted otherwise)
        pool = obj.api.get(f"/pools/{found['pool']}") if found.get("pool") else None
    except ApiError:
        pool = None
    leases = obj.api.list("/node-leases", node=found["id"], state=["granted", "active"])
    # The general event timeline (GET /events, newest first): the last DESCRIBE_EVENTS of them.
    page = obj.api.get("/events", node=found["id"], page_size=describe_mod.DESCRIBE_EVENTS)
    described = describe_mod.describe_node(found, leases, page.get("results") or [], pool=pool)
    render.print_whole(console(), described)


@describe.command("pool")
@click.argument("pool")
@click.pass_obj
def describe_pool(obj: Context, pool):
    """A pool: provisioning and consolidation, its disruption budgets and windows, the disruptions
    allowed now, blocked ones, drift and expiry, and repair (the breaker, the outage guard, the
    rules, the repairs in progress)."""
    found = obj.api.get(f"/pools/{pool}")
    disruptions = obj.api.get(f"/pools/{pool}/disruptions")
    operations = obj.api.get(f"/pools/{pool}/operations")
    replacements = obj.api.get(f"/pools/{pool}/replacements")
    repairs = obj.api.get(f"/pools/{pool}/repairs")
    described = describe_mod.describe_pool(found, disruptions, operations, replacements, repairs)
    render.print_whole(console(), described)


def _act(api: Api, node_ref: str, action: str, body: dict, *, expected: int | None, force: bool, params=None):
    """POST a node action with the node's version as If-Match; one retry on 412 with ``force``."""
    node = api.node(node_ref)
    path = f"/nodes/{node['id']}"
    etag = f'"{expected}"' if expected is not None else api.get_with_version(path)[1]
    try:
        return node, api.post(f"{path}/{action}", body, etag=etag, params=params)
    except ApiError as exc:
        if exc.status != 412 or not force:
            raise
        _, etag = api.get_with_version(path)
        return node, api.post(f"{path}/{action}", body, etag=etag, params=params)


def _name(node: dict) -> str:
    return f"node/{node.get('hostname') or node['id']}"


@cli.command()
@OPTIONAL_NODE
@REASON
@click.option(
    "--expires-at",
    default=None,
    callback=time_option,
    help="RFC 3339 time with an offset (2026-12-01T06:00:00Z) at which your hold ends by itself.",
)
@EXPECTED
@FORCE
@BULK
@click.option("--dry-run", is_flag=True, help="With -l: change nothing; list the nodes it would act on.")
@click.pass_obj
def cordon(obj: Context, node, reason, expires_at, expected_version, force, selector, expect, pool, dry_run):
    """Place your own cordon hold on NODE (or on every node -l picks): no new work lands there;
    its leases keep running."""
    _one_or_many(node, selector)
    if selector is not None:
        if expires_at:
            raise click.UsageError("--expires-at applies to one NODE")
        _bulk(obj, "cordon", selector=selector, expect=expect, pool=pool, dry_run=dry_run, body={"reason": reason})
        return
    body = {"reason": reason, **({"expires_at": expires_at} if expires_at else {})}
    found, _ = _act(obj.api, node, "cordon", body, expected=expected_version, force=force)
    click.echo(f"{_name(found)} cordoned")


@cli.command()
@OPTIONAL_NODE
@REASON
@click.option("--owner", default=None, help="Whose hold to remove (default: your own), e.g. user:olivia.")
@click.option("--override", is_flag=True, help="Operators: remove another actor's hold (or, without --owner, all).")
@EXPECTED
@FORCE
@BULK
@click.option("--dry-run", is_flag=True, help="With -l: change nothing; list the nodes it would act on.")
@click.pass_obj
def uncordon(obj: Context, node, reason, owner, override, expected_version, force, selector, expect, pool, dry_run):
    """Remove your cordon hold from NODE, or from every node -l picks (a node stays cordoned while
    other actors' holds remain)."""
    _one_or_many(node, selector)
    if selector is not None:
        if owner or override:
            raise click.UsageError("--owner and --override apply to one NODE")
        _bulk(obj, "uncordon", selector=selector, expect=expect, pool=pool, dry_run=dry_run, body={"reason": reason})
        return
    body = {"reason": reason, "force": override, **({"owner": owner} if owner else {})}
    found, response = _act(obj.api, node, "uncordon", body, expected=expected_version, force=force)
    still = response.json().get("cordoned")
    holds = ", ".join(h["owner"] for h in response.json().get("holds") or [])
    click.echo(f"{_name(found)} uncordoned" if not still else f"{_name(found)} still cordoned by {holds}")


@cli.command()
@OPTIONAL_NODE
@REASON
@click.option(
    "--deadline",
    required=True,
    callback=deadline_option,
    help="When leases must be gone: 30m, 2h, 1d, or an RFC 3339 time with an offset.",
)
@click.option(
    "--policy",
    type=click.Choice(DRAIN_POLICIES),
    default="wait",
    show_default=True,
    help="wait: let leases finish; checkpoint: ask workloads to checkpoint and move; terminate: revoke leases now.",
)
@click.option(
    "--dry-run", is_flag=True, help="Change nothing; show what would happen to each lease (each node with -l)."
)
@EXPECTED
@FORCE
@BULK
@click.pass_obj
def drain(obj: Context, node, reason, deadline, policy, dry_run, expected_version, force, selector, expect, pool):
    """Drain NODE (or every node -l picks): no new work, its leases end by the deadline per the
    policy, then maintenance. With -l each node passes the disruption gate: pool and workload
    disruption budgets may block some (listed, exit status 1) while the others drain."""
    _one_or_many(node, selector)
    if selector is not None:
        body = {"reason": reason, "policy": policy, **deadline}
        _bulk(obj, "drain", selector=selector, expect=expect, pool=pool, dry_run=dry_run, body=body)
        return
    body = {"reason": reason, "policy": policy, **deadline}
    params = {"dry_run": "true"} if dry_run else None
    found, response = _act(obj.api, node, "drain", body, expected=expected_version, force=force, params=params)
    data = response.json()
    if dry_run:
        summary = data.get("summary") or {}
        counts = (summary.get("leases", 0), summary.get("placeable_elsewhere", 0), summary.get("unplaceable", 0))
        click.echo(f"{_name(found)} would drain (dry run): {counts[0]} lease(s), {counts[1]} placeable elsewhere, "
                   f"{counts[2]} not")  # fmt: skip
        for lease in data.get("leases") or []:
            placeable = "placeable elsewhere" if (lease.get("placement") or {}).get("placeable") else "not placeable"
            lease_id = str(lease.get("lease_id", ""))[:8]
            click.echo(f"  lease {lease_id} of {lease.get('workload_id')}: {lease.get('action')}, {placeable}")
        return
    click.echo(f"{_name(found)} draining (drain {data.get('id')}, deadline {data.get('deadline')})")


@cli.command()
@NODE
@REASON
@click.option("--evidence", default="{}", help="What was observed, as a JSON object.")
@EXPECTED
@FORCE
@click.pass_obj
def quarantine(obj: Context, node, reason, evidence, expected_version, force):
    """Quarantine NODE: its credentials and leases are revoked at once; its owner sees why."""
    try:
        evidence_obj = json.loads(evidence)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--evidence") from None
    if not isinstance(evidence_obj, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--evidence")
    body = {"reason": reason, "evidence": evidence_obj}
    found, _ = _act(obj.api, node, "quarantine", body, expected=expected_version, force=force)
    click.echo(f"{_name(found)} quarantined")


@cli.command()
@NODE
@REASON
@click.option(
    "--issue-credential",
    is_flag=True,
    help="Issue the node a new credential (shown once) for its agent: nodepool-agent set-credential takes it.",
)
@click.option(
    "--credential-file",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    help="With --issue-credential: write the credential here (mode 0600) instead of printing it.",
)
@EXPECTED
@FORCE
@click.pass_obj
def release(obj: Context, node, reason, issue_credential, credential_file, expected_version, force):
    """Release NODE from quarantine (or rejection): it is admitted afresh. Its agent comes back as
    the same node with --issue-credential (then `nodepool-agent set-credential --file F` on the
    node), or with a bootstrap token naming the node (docs/agent.md, "Coming back")."""
    if credential_file is not None and not issue_credential:
        raise click.UsageError("--credential-file needs --issue-credential")
    body = {"reason": reason, **({"issue_credential": True} if issue_credential else {})}
    found, response = _act(obj.api, node, "release", body, expected=expected_version, force=force)
    click.echo(f"{_name(found)} released")
    if not issue_credential:
        return
    handed = {"node_id": found["id"], "credential": response.json()["credential"], "expires_at": ""}
    if credential_file is None:
        click.echo(f"credential (shown once): {handed['credential']}")
        click.echo(f"on the node: nodepool-agent set-credential --credential {handed['credential']}")
        return
    _write_private(credential_file, json.dumps(handed) + "\n")
    click.echo(f"credential written to {credential_file} (mode 0600); copy it to the node and run: "
               f"nodepool-agent set-credential --file {credential_file.name}")  # fmt: skip


def _write_private(path: Path, text: str) -> None:
    """Create or replace ``path`` with mode 0600 from the start (it holds a secret)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its old mode through O_CREAT


# The command groups in their own modules (they import this one's helpers: imported last).
from .leases import lease  # noqa: E402  (the lease command group)
from .top import top  # noqa: E402  (kubectl top)
from .watch import watch  # noqa: E402

cli.add_command(lease)
cli.add_command(top)
cli.add_command(watch)


@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell):
    """Print the tab-completion script: eval "$(nodepoolctl completion bash)"."""
    # Lazy: a CLI starts fast, and only this command needs click's completion machinery.
    from click.shell_completion import get_completion_class

    complete = get_completion_class(shell)(cli, {}, "nodepoolctl", "_NODEPOOLCTL_COMPLETE")
    click.echo(complete.source())


def main() -> None:
    cli(prog_name="nodepoolctl")
