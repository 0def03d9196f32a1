"""How nodepoolctl shows objects: kubectl's columns (``get``), sections (``describe``), and the
json / yaml / name outputs. Amounts come from the API in canonical units (cpu millicores, bytes)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable

import yaml
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table

import humanunits

# Amounts and times come from the one formatting module shared with the server (issue 33 item 4).
amount = humanunits.quantity  # 7900 cpu -> "7900m", 2100 -> "2.1"; bytes -> "23.5Gi"; None -> "-"
age = humanunits.age  # kubectl's AGE since an RFC 3339 time: "45s", "5m30s", "3h12m"; None -> "<none>"
timestamp = humanunits.timestamp  # the one absolute format: "2026-12-02 09:48:53 UTC"


def console() -> Console:
    # Made per call, not at import: Rich reads the terminal width (or COLUMNS) when constructed.
    return Console(highlight=False, soft_wrap=True)


def free(node: dict, resource: str) -> str:
    entry = (node.get("capacity") or {}).get(resource)
    return amount(resource, entry.get("free")) if entry else "-"


def free_models(devices: dict | None) -> str:
    """``"4×H100 2×A100"``: free devices by model from a node's ``devices`` field (its
    ``free_models`` per type), most first; "" when none is free or the server sends none."""
    counts: dict = {}
    for entry in (devices or {}).values():
        for model, n in (entry.get("free_models") or {}).items():
            counts[model] = counts.get(model, 0) + n
    return " ".join(f"{n}×{model}" for model, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])))


READY_WORDS = {"ready": "True", "not_ready": "False", "unknown": "Unknown"}


def ready(node: dict) -> str:
    """kubectl's Ready: ``True``, ``False``, or ``Unknown`` once the node is unreachable, lost or
    never heard from (the server's ``readiness``; from ``ready`` alone for a server without it)."""
    state = node.get("readiness")
    if state in READY_WORDS:
        return READY_WORDS[state]
    return "True" if node.get("ready") else "False"


def health(node: dict) -> str:
    """The health as shown (``unknown`` once the node's signals are not current)."""
    return node.get("health_state") or node.get("health", "")


STATUS_WORDS = {"True": "Ready", "False": "NotReady", "Unknown": "Unknown"}


def _status(node: dict) -> str:
    """kubectl's STATUS: ``Ready``, ``NotReady`` or ``Unknown`` (unreachable, lost, never heard from),
    plus ``SchedulingDisabled`` when cordoned. Each fact once: the lifecycle has its own column and
    the reasons a node takes no work are in ``describe``."""
    word = STATUS_WORDS[ready(node)]
    return f"{word},SchedulingDisabled" if node.get("cordoned") else word


def _resources(resources: dict | None) -> str:
    return ",".join(f"{k}={amount(k, v)}" for k, v in sorted((resources or {}).items())) or "-"


def _labels(labels: dict | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items())) or "<none>"


# kind -> (name of an object, columns [(header, getter)], extra columns for -o wide)
Column = tuple[str, Callable[[dict], str]]
KINDS: dict[str, tuple[Callable[[dict], str], list[Column], list[Column]]] = {
    "node": (
        lambda n: n.get("hostname") or n["id"],
        [
            ("NAME", lambda n: n.get("hostname") or n["id"]),
            ("POOL", lambda n: n.get("pool") or ""),
            ("STATUS", _status),
            ("LIVENESS", lambda n: n.get("liveness", "")),
            ("LIFECYCLE", lambda n: n.get("lifecycle", "")),
            ("HEALTH", health),
            ("CPU FREE", lambda n: free(n, "cpu")),
            ("MEMORY FREE", lambda n: free(n, "memory")),
            ("GPU FREE", lambda n: free(n, "nvidia.com/gpu")),
            ("HEARTBEAT", lambda n: age(n.get("last_heartbeat_at"))),
        ],
        [
            ("ID", lambda n: n["id"]),
            ("VERSION", lambda n: str(n.get("version", ""))),
            ("AGENT", lambda n: n.get("agent_version") or ""),
            ("LABELS", lambda n: _labels(n.get("labels"))),
            ("FREE DEVICES", lambda n: free_models(n.get("devices")) or "-"),
        ],
    ),
    "pool": (
        lambda p: p["name"],
        [
            ("NAME", lambda p: p["name"]),
            ("KIND", lambda p: p.get("kind", "")),
            ("ADMISSION", lambda p: p.get("admission_mode", "")),
            ("NODES", lambda p: str(p.get("node_count", ""))),
            ("POLICY", lambda p: p.get("scheduling_policy", "")),
        ],
        [("VERSION", lambda p: str(p.get("version", ""))), ("LABELS", lambda p: _labels(p.get("labels")))],
    ),
    "lease": (
        lambda lease: lease["id"],
        [
            ("ID", lambda lease: lease["id"]),
            ("WORKLOAD", lambda lease: lease.get("workload_id", "")),
            ("NODE", lambda lease: node_name(lease, "node_id")),
            ("TOKEN", lambda lease: str(lease.get("fencing_token", ""))),
            ("STATE", lambda lease: lease.get("state", "")),
            ("WORKLOAD STATE", lambda lease: lease.get("workload_state") or "-"),
            ("EXPIRES", lambda lease: timestamp(lease.get("expires_at"))),
        ],
        [
            ("POOL", lambda lease: lease.get("pool") or ""),
            (
                "RESOURCES",
                lambda lease: ",".join(f"{k}={amount(k, v)}" for k, v in (lease.get("resources") or {}).items()),
            ),
            ("DEVICES", lambda lease: ",".join(d["id"] for d in lease.get("devices") or []) or "-"),
            ("PLACEMENT", lambda lease: placement(lease.get("placement"))),
            ("VERSION", lambda lease: str(lease.get("version", ""))),
        ],
    ),
    "device": (
        lambda d: d["id"],
        [
            ("ID", lambda d: d["id"]),
            ("TYPE", lambda d: d.get("type", "")),
            ("INDEX", lambda d: str(d.get("index", ""))),
            ("MODEL", lambda d: d.get("model") or "-"),
            ("MEMORY", lambda d: amount("memory", d.get("memory_bytes"))),
            ("GROUP", lambda d: d.get("interconnect_group") or "-"),
            ("HEALTH", lambda d: d.get("health", "")),
            ("ALLOCATABLE", lambda d: "True" if d.get("allocatable") else "False"),
            ("TAINTS", lambda d: ",".join(f"{t['key']}:{t['effect']}" for t in d.get("taints") or []) or "<none>"),
        ],
        [
            ("NUMA", lambda d: "-" if d.get("numa_node") is None else str(d["numa_node"])),
            ("MIG", lambda d: d.get("mig_profile") or "-"),
            ("VERIFIED", lambda d: timestamp(d.get("verified_at")) if d.get("verified_at") else "<no>"),
            ("HELD", lambda d: "True" if d.get("held") else "False"),
        ],
    ),
    "drain": (
        lambda d: d["id"],
        [
            ("ID", lambda d: d["id"]),
            ("NODE", lambda d: (d.get("node") or {}).get("hostname") or (d.get("node") or {}).get("id", "")),
            ("STATE", lambda d: d.get("state", "")),
            ("POLICY", lambda d: d.get("policy", "")),
            ("DEADLINE", lambda d: timestamp(d.get("deadline"))),
            ("LEASES LEFT", lambda d: str(d.get("leases_remaining", ""))),
        ],
        [("REASON", lambda d: d.get("reason", "")), ("BY", lambda d: d.get("requested_by_name") or "")],
    ),
    "quarantine": (
        lambda q: q["id"],
        [
            ("ID", lambda q: str(q["id"])),
            ("NODE", lambda q: node_name(q, "node")),
            ("RULE", lambda q: q.get("rule", "")),
            ("SINCE", lambda q: age(q.get("created_at"))),
            ("RELEASED", lambda q: timestamp(q.get("released_at")) if q.get("released_at") else "<open>"),
        ],
        [("REASON", lambda q: q.get("reason", ""))],
    ),
    "event": (
        lambda e: str(e["id"]),
        [
            ("LAST SEEN", lambda e: age(e.get("created_at"))),
            ("TYPE", lambda e: e.get("type", "")),
            ("OBJECT", lambda e: event_object(e)),
            ("BY", lambda e: e.get("actor") or e.get("actor_type") or ""),
            ("MESSAGE", lambda e: " ".join(str(e.get("summary") or e.get("reason") or "").split())),
        ],
        [("POOL", lambda e: e.get("pool") or "-"), ("ID", lambda e: str(e["id"]))],
    ),
}

# The columns a default table gives up, first to last, to fit the width (COLUMNS, or the terminal):
# the name and its status never; `-o wide` shows them all. A column in SQUEEZE (free text) is cut
# short with an ellipsis when dropping is not enough; names and ids never are.
DROP = {
    "node": ["GPU FREE", "HEALTH", "LIVENESS", "MEMORY FREE", "CPU FREE", "LIFECYCLE", "HEARTBEAT", "POOL"],
    "pool": ["POLICY", "ADMISSION", "KIND"],
    "lease": ["WORKLOAD STATE", "TOKEN", "EXPIRES", "STATE", "WORKLOAD"],
    "device": ["TAINTS", "GROUP", "MEMORY", "MODEL", "ALLOCATABLE", "INDEX"],
    "drain": ["LEASES LEFT", "POLICY", "DEADLINE"],
    "quarantine": ["RELEASED", "RULE", "SINCE"],
    "event": ["BY"],  # then MESSAGE is cut short: OBJECT (which node) stays
}
SQUEEZE = {"event": "MESSAGE"}
NODE_NAME_KEY = "_node_name"  # set on an object (a table only) by the caller that resolved its node's name


def node_name(obj: dict, key: str) -> str:
    """The node's name (hostname) when the caller resolved it, else its id."""
    return obj.get(NODE_NAME_KEY) or str(obj.get(key) or "")


def event_object(event: dict) -> str:
    """kubectl's OBJECT: ``node/<name>``, ``lease/<workload>`` or ``pool/<name>``."""
    if event.get("node_id"):
        return f"node/{node_name(event, 'node_id')}"
    if event.get("workload_id") or event.get("lease_id"):
        return f"lease/{event.get('workload_id') or event.get('lease_id')}"
    return f"pool/{event['pool']}" if event.get("pool") else f"{event.get('subject_type') or '-'}"


def placement(asked: dict | None) -> str:
    """What a lease's request asked of its node, in one cell: ``selector zone=a; tolerates
    gpu=true:NoSchedule; affinity 1 required; spread web by zone; features arch=amd64``."""
    asked = asked or {}
    parts = []
    if asked.get("node_selector"):
        parts.append("selector " + ",".join(f"{k}={v}" for k, v in sorted(asked["node_selector"].items())))
    if asked.get("tolerations"):
        tolerations = [
            f"{t.get('key') or '*'}{'=' + t['value'] if t.get('value') else ''}:{t.get('effect') or '*'}"
            for t in asked["tolerations"]
        ]
        parts.append("tolerates " + ",".join(tolerations))
    affinity = asked.get("affinity") or {}
    if affinity:
        counts = [f"{len(affinity.get(k) or [])} {k}" for k in ("required", "preferred") if affinity.get(k)]
        parts.append("affinity " + ", ".join(counts))
    spread = asked.get("spread") or {}
    if spread:
        parts.append(f"spread {spread.get('group')} by {spread.get('topology_key') or 'host'}"
                     f"{' (' + spread['mode'] + ')' if spread.get('mode') else ''}")  # fmt: skip
    if asked.get("features"):
        parts.append("features " + ",".join(f"{k}={v}" for k, v in sorted(asked["features"].items())))
    return "; ".join(parts) or "-"


def table(kind: str, objects: list[dict], *, wide: bool = False, width: int | None = None) -> Table:
    """The objects one row each. A cell is never folded onto a second line (``LIVENES``/``S``, an
    id cut in two): printed with :func:`print_whole` every cell is whole; squeezed into a narrower
    console (``watch`` on a terminal) a cell is cut short with an ellipsis, still on its row.

    ``width`` (characters; default tables only): the columns of :data:`DROP` are left out, in
    that order, until every line fits; then the free-text column of :data:`SQUEEZE` is cut short.
    A name is never cut: with a name longer than ``width`` the line is as long as the name needs."""
    _, columns, extra = KINDS[kind]
    columns = columns + extra if wide else list(columns)
    rows = [[str(get(obj)) for _, get in columns] for obj in objects]
    headers = [header for header, _ in columns]
    if width and not wide:
        headers, rows = _fit(kind, headers, rows, width)
    out = Table(box=None, header_style="bold", pad_edge=False)
    for header in headers:
        out.add_column(header, no_wrap=True, overflow="ellipsis")
    for row in rows:
        out.add_row(*row)
    return out


GAP = 2  # characters between two columns (Rich's default padding of a box-less table)


def _line_width(headers: list[str], rows: list[list[str]]) -> int:
    widths = [max([cell_len(h), *(cell_len(row[i]) for row in rows)]) for i, h in enumerate(headers)]
    return sum(widths) + GAP * (len(widths) - 1)


def _fit(kind: str, headers: list[str], rows: list[list[str]], width: int) -> tuple[list[str], list[list[str]]]:
    for dropped in DROP.get(kind, []):
        if _line_width(headers, rows) <= width:
            break
        if dropped in headers:
            index = headers.index(dropped)
            headers = headers[:index] + headers[index + 1 :]
            rows = [row[:index] + row[index + 1 :] for row in rows]
    squeeze = SQUEEZE.get(kind)
    if squeeze in headers and _line_width(headers, rows) > width:
        index = headers.index(squeeze)
        others = _line_width(headers[:index] + headers[index + 1 :], [r[:index] + r[index + 1 :] for r in rows])
        room = max(len(squeeze), width - others - GAP)
        rows = [row[:index] + [_cut(row[index], room)] + row[index + 1 :] for row in rows]
    return headers, rows


def _cut(text: str, room: int) -> str:
    return text if cell_len(text) <= room else text[: max(room - 1, 0)] + "…"


def fit_width() -> int | None:
    """The width a default table must fit: ``COLUMNS`` when set, else the terminal's; ``None``
    (every column, each cell whole) when the output is a pipe or a file without ``COLUMNS``."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


WIDEST = 100_000  # characters: any table's natural width is below this


def natural_width(console: Console, renderable: RenderableType) -> int:
    """How wide ``renderable`` is when every cell is as wide as its content."""
    return max(1, Measurement.get(console, console.options.update_width(WIDEST), renderable).maximum)


def print_whole(console: Console, renderable: RenderableType) -> None:
    """Print with columns as wide as their content (kubectl): one row per line, no cell folded or
    cut, whatever the width of the terminal (it wraps a longer line) or of ``COLUMNS`` when the
    output is a pipe or a file, which scripts read line by line."""
    console.width = max(console.width, natural_width(console, renderable))
    with console.capture() as captured:
        console.print(renderable)
    # Rich pads every line to the console's width: a describe line would end in ~200 spaces.
    console.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    console.file.flush()


def dump(objects: list[dict] | dict, output: str) -> str:
    """``json`` or ``yaml`` text of ``objects``."""
    if output == "json":
        return json.dumps(objects, indent=2, sort_keys=True, default=str)
    return yaml.safe_dump(json.loads(json.dumps(objects, default=str)), sort_keys=True)


def names(kind: str, objects: list[dict]) -> str:
    name_of = KINDS[kind][0]
    return "\n".join(f"{kind}/{name_of(obj)}" for obj in objects)
