"""``describe node`` (kubectl describe's shape: fields, conditions in order, capacity, holds,
leases, events last) and ``top pool`` (capacity per pool from the node list)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from . import render
from .render import age, amount, health, ready, timestamp


def _grid(rows: list[tuple[str, str]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(no_wrap=True, overflow="ellipsis")
    for key, value in rows:
        grid.add_row(f"{key}:", value)
    return grid


def _pairs(labels: dict | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted((labels or {}).items())) or "<none>"


def _with(value, detail) -> str:
    return f"{value} ({detail})" if detail else f"{value}"


def _shown(shown: str, reported, detail: str | None, reported_at: str | None) -> str:
    """The value as shown; once it is ``Unknown`` (node unreachable, lost, never heard from) the last
    reported value and its age follow: ``Unknown (last reported True 5m ago: booting)``."""
    if shown.lower() != "unknown" or str(reported).lower() == "unknown":
        return _with(shown, detail)
    last = f"last reported {reported} {age(reported_at)} ago" if reported_at else f"last reported {reported}"
    return f"{shown} ({last}: {detail})" if detail else f"{shown} ({last})"


def _section(title: str, body) -> list:
    return [Text(f"{title}:", style="bold"), body]


def _table(headers: list[str], rows: list[list[str]], empty: str = "<none>"):
    if not rows:
        return Text(f"  {empty}")
    out = Table(box=None, header_style="bold", pad_edge=True)
    for header in headers:
        out.add_column(header, no_wrap=True, overflow="ellipsis")
    for row in rows:
        out.add_row(*row)
    return out


DESCRIBE_EVENTS = 20  # the node's latest events shown by describe


def _status_report(node: dict) -> str:
    """When the last status report arrived and its age (what readiness, health and usage are as old
    as; renewals keep only liveness fresh): ``2026-12-02T10:00:00Z (12s ago)`` or ``never``."""
    at = node.get("last_status_report_at")
    return f"{at} ({age(at)} ago)" if at else "never"


def _node_labels(node: dict, pool: dict | None) -> str:
    """The labels the node declares, marked when its pool does not trust them: placement and the
    ``-l`` selector then ignore them (only platform, pool and identity labels count)."""
    pairs = _pairs(node.get("node_labels"))
    if not node.get("node_labels") or pool is None or pool.get("trust_node_labels", True):
        return pairs
    name = pool.get("name") or node.get("pool")
    return f"{pairs} (untrusted: pool {name} does not trust node labels; placement and -l ignore them)"


def describe_node(node: dict, leases: list[dict], events: list[dict], *, pool: dict | None = None) -> Group:
    """The node as sections, events last (oldest first, as kubectl lists them).

    ``events`` are items of ``GET /events?node=`` (``created_at``, ``type``, ``from_state``,
    ``to_state``, ``actor``, ``reason``), in any order. ``pool`` is ``GET /pools/{name}`` of the
    node's pool (whether it trusts node labels); without it node labels are shown unmarked.
    """
    reasons = node.get("unschedulable_reasons") or []
    taints = [f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}" for t in node.get("taints") or []]
    heartbeat = f"last heartbeat {age(node.get('last_heartbeat_at'))} ago"
    agent = f"incarnation {node.get('incarnation')}, sequence {node.get('sequence')}"
    fields = [
        ("Name", node.get("hostname") or "-"),
        ("ID", node["id"]),
        ("Pool", node.get("pool") or "-"),
        ("Owner", node.get("owner") or "<none>"),
        ("Labels", _pairs(node.get("labels"))),
        ("Node labels", _node_labels(node, pool)),
        ("Taints", ", ".join(taints) or "<none>"),
        ("Lifecycle", _with(node.get("lifecycle"), node.get("lifecycle_reason"))),
        ("Cordoned", "yes" if node.get("cordoned") else "no"),
        ("Liveness", _with(node.get("liveness"), heartbeat)),
        ("Status report", _status_report(node)),
        ("Ready", _shown(ready(node), node.get("ready"), node.get("ready_reason"), node.get("last_status_report_at"))),
        (
            "Health",
            _shown(
                health(node),
                node.get("health"),
                ", ".join(node.get("health_reasons") or []),
                (node.get("reported_health") or {}).get("reported_at") or node.get("last_status_report_at"),
            ),
        ),
        ("Schedulable", "yes" if node.get("schedulable") else "no: " + "; ".join(r["message"] for r in reasons)),
        ("Agent", _with(node.get("agent_version") or "-", agent)),
        ("Version", str(node.get("version"))),
    ]
    conditions = [
        [c.get("type", ""), str(c.get("status", "")), c.get("reason") or "", c.get("message") or "",
         timestamp(c.get("last_transition_time"))]
        for c in node.get("conditions") or []
    ]  # fmt: skip
    capacity = [
        [name, *(amount(name, r.get(k)) for k in ("capacity", "reserved", "allocatable", "allocated", "free"))]
        for name, r in sorted((node.get("capacity") or {}).items())
    ]
    holds = [
        [h.get("owner", ""), h.get("reason") or "", timestamp(h.get("created_at")),
         timestamp(h.get("expires_at")) if h.get("expires_at") else "<never>"]
        for h in node.get("holds") or []
    ]  # fmt: skip
    lease_rows = [
        [lease.get("workload_id", ""), str(lease.get("fencing_token", "")), lease.get("state", ""),
         lease.get("workload_state") or "-", timestamp(lease.get("expires_at"))]
        for lease in leases
    ]  # fmt: skip
    event_rows = [
        [age(e.get("created_at")), e.get("type", ""),
         f"{e.get('from_state') or ''}→{e.get('to_state') or ''}" if e.get("from_state") or e.get("to_state") else "",
         e.get("actor") or e.get("actor_type", ""), e.get("reason") or ""]
        for e in sorted(events, key=lambda e: e.get("created_at") or "")
    ]  # fmt: skip
    parts = [_grid(fields)]
    parts += _section("Conditions", _table(["TYPE", "STATUS", "REASON", "MESSAGE", "LAST TRANSITION"], conditions))
    parts += _section(
        "Capacity", _table(["RESOURCE", "CAPACITY", "RESERVED", "ALLOCATABLE", "ALLOCATED", "FREE"], capacity)
    )
    device_rows = [
        [kind, str(entry.get("total", 0)), str(entry.get("allocatable", 0)), str(entry.get("free", 0)),
         render.free_models({kind: entry}) or "-",
         ", ".join(f"{model or '?'} x{n}" for model, n in sorted((entry.get("models") or {}).items()))]
        for kind, entry in sorted((node.get("devices") or {}).items())
    ]  # fmt: skip
    if device_rows:
        headers = ["TYPE", "TOTAL", "ALLOCATABLE", "FREE", "FREE BY MODEL", "MODELS"]
        parts += _section("Devices", _table(headers, device_rows))
    if node.get("reliability_record"):
        parts += _section("Reliability", _reliability(node["reliability_record"]))
    parts += _section("Cordon holds", _table(["OWNER", "REASON", "SINCE", "EXPIRES"], holds))
    parts += _section("Leases", _table(["WORKLOAD", "TOKEN", "STATE", "WORKLOAD STATE", "EXPIRES"], lease_rows))
    parts += _section("Events", _table(["AGE", "TYPE", "CHANGE", "BY", "REASON"], event_rows))
    return Group(*parts)


def _fraction(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _reliability(record: dict) -> Group:
    """The node's reliability record (docs/fleet.md, "Reliability"): the score placement compares,
    then per window uptime and leases completed against lost or failed through the node's fault,
    the causes of those losses, faults per device and the re-verification runs."""
    days = record.get("window_days")
    score = (
        f"{record['reliability']:.4f} ({days} days)"
        if record.get("rated")
        else f"unrated (fewer than {record.get('min_sample')} counted leases in {days} days)"
    )
    windows = record.get("windows") or {}
    rows = [
        [name, _fraction(w.get("uptime")), str(w.get("leases_completed", 0)), str(w.get("leases_node_fault", 0)),
         _fraction(w.get("reliability"))]
        for name, w in windows.items()
    ]  # fmt: skip
    longest = windows.get(max(windows, key=lambda k: windows[k].get("days", 0))) if windows else {}
    causes = ", ".join(f"{k} {n}" for k, n in (longest.get("leases_node_fault_by_cause") or {}).items() if n)
    faults = ", ".join(f"{device} x{n}" for device, n in (record.get("device_faults") or {}).items())
    runs = record.get("reverifications") or {}
    last = (runs.get("runs") or [{}])[0]
    checks = f"{runs.get('passed', 0)} passed, {runs.get('failed', 0)} failed" + (
        f" (last {last.get('state')}: {last.get('code')}, {age(last.get('finished_at'))} ago)" if last else ""
    )
    return Group(
        _grid([
            ("Score", score),
            ("Node-fault losses", causes or "<none>"),
            ("Device faults", faults or "<none>"),
            ("Re-verifications", checks),
        ]),
        _table(["WINDOW", "UPTIME", "COMPLETED", "NODE-FAULT LOSSES", "RELIABILITY"], rows),
    )  # fmt: skip


def describe_pool(
    pool: dict,
    disruptions: dict,
    operations: dict | None = None,
    replacements: dict | None = None,
    repairs: dict | None = None,
) -> Group:
    """The pool as sections: its fields, provisioning (back-off, launches, fallback pools) and
    consolidation when ``operations`` (``GET /pools/{name}/operations``) is given, disruption
    budgets (each with its window, active or next), the disruptions allowed now per reason, the
    nodes automation may not disrupt, each with its blocker, drift and expiry when
    ``replacements`` (``GET /pools/{name}/replacements``) is given: the shape hash, expiry
    settings, drifted and expired nodes, replacements; and repair when ``repairs``
    (``GET /pools/{name}/repairs``) is given: the breaker, the outage guard, the rules and the
    repairs in progress. ``disruptions`` is ``GET /pools/{name}/disruptions``."""
    fields = [
        ("Name", pool.get("name") or "-"),
        ("Kind", pool.get("kind") or "-"),
        ("Labels", _pairs(pool.get("labels"))),
        ("Nodes", f"{disruptions.get('members', 0)} ({disruptions.get('disrupting', 0)} disrupting)"),
        ("Ready objective", str(pool.get("ready_ratio_objective") or "<none>")),
    ]
    budgets = [
        [
            str(b.get("index")),
            str(b.get("nodes")),
            str(b.get("limit")),
            ", ".join(b.get("reasons") or []) or "all",
            f"{b['schedule']} for {b.get('duration')} ({b.get('timezone', 'UTC')})" if b.get("schedule") else "always",
            ("active" if b.get("active") else "inactive")
            + (f" {b.get('window_start')} → {b.get('window_end')}" if b.get("window_start") else ""),
        ]
        for b in disruptions.get("budgets") or []
    ]
    allowed = [
        [reason, "unlimited" if n is None else str(n)]
        for reason, n in (disruptions.get("allowed_disruptions") or {}).items()
    ]
    blocked = [
        [b.get("node", ""), b.get("reason", ""), b.get("kind", ""), age(b.get("since")), b.get("detail", "")]
        for b in disruptions.get("blocked") or []
    ]
    parts = [_grid(fields)]
    if operations and operations.get("provider"):
        after = operations.get("consolidate_after")
        parts += _section("Provisioning", _grid([
            ("Provider", f"{operations['provider']} "
                         f"({operations.get('min_nodes')}..{operations.get('max_nodes')} nodes)"),
            ("Launches in flight", f"at most {operations.get('max_launches_in_flight')}"),
            ("Back-off", f"{operations.get('scale_up_backoff_base')}s doubled per failure, at most "
                         f"{operations.get('scale_up_backoff_max')}s"),
            ("Consecutive failures", str(operations.get("consecutive_failures", 0))),
            ("Backing off until", operations.get("backoff_until") or "<not backing off>"),
            ("Fallback pools", ", ".join(operations.get("fallback_pools") or []) or "<none>"),
            ("Consolidation", "off" if after is None else
             f"empty nodes after {after}s; replace when saving ≥ {operations.get('consolidation_min_saving'):.0%}"),
        ]))  # fmt: skip
    parts += _section("Disruption budgets", _table(["#", "NODES", "LIMIT", "REASONS", "SCHEDULE", "WINDOW"], budgets))
    parts += _section("Allowed disruptions", _table(["REASON", "ALLOWED NOW"], allowed))
    parts += _section("Blocked disruptions", _table(["NODE", "REASON", "BLOCKER", "FOR", "DETAIL"], blocked))
    if replacements is not None:
        parts += _drift_and_expiry(replacements)
    if repairs is not None:
        parts += _repair_sections(repairs)
    return Group(*parts)


def _drift_and_expiry(data: dict) -> list:
    """The "Drift and expiry" sections of ``describe pool`` (``GET /pools/{name}/replacements``)."""
    after, grace = data.get("expire_after"), data.get("termination_grace")
    fields = [
        ("Shape hash", (data.get("shape_hash") or "")[:12] or "-"),
        ("Expire after", "never" if after is None else f"{after}s (spread per node)"),
        ("Termination grace", "never forced" if grace is None else f"{grace}s, then forced"),
        ("Drifted nodes", str(len(data.get("drifted") or []))),
        ("Expired nodes", str(len(data.get("expired") or []))),
    ]
    if data.get("guard"):
        fields.append(("Expiry stands still", data["guard"]))
    drifted = [
        [d.get("node", ""), (d.get("condition") or {}).get("reason", ""), age(d.get("since")),
         (d.get("condition") or {}).get("message", "")]
        for d in data.get("drifted") or []
    ]  # fmt: skip
    rows = [
        [r.get("node", ""), r.get("reason", ""), r.get("state", ""), age(r.get("wanted_since")),
         ("forced: " if r.get("forced") else "") + (r.get("detail") or "")]
        for r in data.get("replacements") or []
    ]  # fmt: skip
    parts = _section("Drift and expiry", _grid(fields))
    parts += _section("Drifted nodes", _table(["NODE", "REASON", "FOR", "WHY"], drifted))
    parts += _section("Replacements", _table(["NODE", "REASON", "STATE", "WANTED FOR", "DETAIL"], rows))
    return parts


def _repair_sections(repairs: dict) -> list:
    breaker = repairs.get("breaker") or {}
    state = f"OPEN since {breaker.get('since')}: {breaker.get('detail')}" if breaker.get("open") else "closed"
    fields = [
        ("Breaker", state),
        ("Unhealthy", f"{repairs.get('unhealthy', 0)} of {repairs.get('members', 0)} "
                      f"(opens above {float(repairs.get('max_unhealthy') or 0):.0%})"),
        ("Outage guard", repairs.get("guard") or "not engaged"),
        ("At once", str(repairs.get("max_concurrent", 1))),
    ]  # fmt: skip
    rules = [
        [str(i), f"{r.get('condition')}={r.get('status')}", f"{r.get('for')}s", r.get("action", "")]
        for i, r in enumerate(repairs.get("rules") or [])
    ]
    active = [
        [r.get("node", ""), r.get("action", ""), r.get("state", ""), r.get("condition", ""), age(r.get("created_at"))]
        for r in repairs.get("in_progress") or []
    ]
    parts = _section("Repair", _grid(fields))
    parts += _section("Repair rules", _table(["#", "CONDITION", "FOR", "ACTION"], rules))
    parts += _section("Repairs in progress", _table(["NODE", "ACTION", "STATE", "CONDITION", "AGE"], active))
    return parts


TOP_RESOURCES = ("cpu", "memory", "nvidia.com/gpu")


def pool_capacity(nodes: list[dict]) -> list[dict]:
    """Capacity per pool from full node objects: node counts, and for cpu, memory and gpu the
    allocatable, allocated and free sums over schedulable nodes (what placement can use now)."""
    pools: dict[str, dict] = {}
    for node in nodes:
        pool = pools.setdefault(
            node.get("pool") or "-",
            {"nodes": 0, "schedulable": 0, **{r: {"allocatable": 0, "allocated": 0, "free": 0} for r in TOP_RESOURCES}},
        )
        pool["nodes"] += 1
        if not node.get("schedulable"):
            continue
        pool["schedulable"] += 1
        for resource in TOP_RESOURCES:
            entry = (node.get("capacity") or {}).get(resource) or {}
            for key in ("allocatable", "allocated", "free"):
                pool[resource][key] += int(entry.get(key) or 0)
    return [{"pool": name, **values} for name, values in sorted(pools.items())]


def pool_capacity_from_api(pool: str, capacity: dict) -> dict:
    """A row of ``top pool`` from the server's ``GET /pools/{name}/capacity`` answer."""
    resources = capacity.get("resources") or {}
    nodes = capacity.get("nodes") or {}
    row = {"pool": pool, "nodes": nodes.get("total", 0), "schedulable": nodes.get("schedulable", 0)}
    for resource in TOP_RESOURCES:
        entry = resources.get(resource) or {}
        row[resource] = {key: int(entry.get(key) or 0) for key in ("allocatable", "allocated", "free")}
    return row


def top_table(rows: list[dict]) -> Table:
    out = Table(box=None, header_style="bold", pad_edge=False)
    for header in (
        "POOL",
        "NODES",
        "SCHEDULABLE",
        "CPU USED/ALLOC",
        "CPU%",
        "MEMORY USED/ALLOC",
        "MEMORY%",
        "GPU FREE",
    ):
        out.add_column(header, no_wrap=True, overflow="ellipsis")
    for row in rows:
        cells = [row["pool"], str(row["nodes"]), str(row["schedulable"])]
        for resource in ("cpu", "memory"):
            r = row[resource]
            cells.append(f"{amount(resource, r['allocated'])}/{amount(resource, r['allocatable'])}")
            cells.append(f"{100 * r['allocated'] // r['allocatable']}%" if r["allocatable"] else "-")
        cells.append(str(row["nvidia.com/gpu"]["free"]))
        out.add_row(*cells)
    return out


def node_usage(node: dict) -> dict:
    """A row of ``top node``: per resource (cpu, memory) the usage the agent last reported
    (``None`` when it has not), the allocated amount and the allocatable (canonical units), and
    the free GPUs."""
    usage = node.get("usage") or {}
    row: dict = {"node": node.get("hostname") or node["id"], "pool": node.get("pool") or ""}
    for resource in ("cpu", "memory"):
        entry = (node.get("capacity") or {}).get(resource) or {}
        row[resource] = {
            "used": usage.get(resource),
            "allocated": int(entry.get("allocated") or 0),
            "allocatable": int(entry.get("allocatable") or 0),
        }
    gpu = (node.get("capacity") or {}).get("nvidia.com/gpu")
    row["gpu_free"] = int(gpu.get("free") or 0) if gpu else None
    return row


def _share(part, whole) -> str:
    return f"{100 * part // whole}%" if whole and part is not None else "-"


def top_node_table(rows: list[dict], *, width: int | None = None) -> Table:
    """kubectl top node's columns (NAME CPU CPU% MEMORY MEMORY%: usage as reported), then what
    leases hold (ALLOC%); without room for all (``width``), the allocation columns go first."""
    headers = ["NAME", "CPU", "CPU%", "MEMORY", "MEMORY%", "CPU ALLOC%", "MEMORY ALLOC%", "GPU FREE"]
    table_rows = []
    for row in rows:
        cells = [row["node"]]
        for resource in ("cpu", "memory"):
            r = row[resource]
            cells.append("<unknown>" if r["used"] is None else amount(resource, r["used"]))
            cells.append(_share(r["used"], r["allocatable"]))
        cells += [_share(row[r]["allocated"], row[r]["allocatable"]) for r in ("cpu", "memory")]
        cells.append("-" if row["gpu_free"] is None else str(row["gpu_free"]))
        table_rows.append(cells)
    keep = len(headers)
    while width and keep > 5 and _width(headers[:keep], table_rows) > width:
        keep -= 1
    out = Table(box=None, header_style="bold", pad_edge=False)
    for header in headers[:keep]:
        out.add_column(header, no_wrap=True, overflow="ellipsis")
    for cells in table_rows:
        out.add_row(*cells[:keep])
    return out


def _width(headers: list[str], rows: list[list[str]]) -> int:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    return sum(widths) + 2 * (len(widths) - 1)
