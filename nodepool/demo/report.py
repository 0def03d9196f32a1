"""The summary an operator reads at the end: nodes, leases, the steps, and where to click."""

from __future__ import annotations

from django.conf import settings

from fleet.choices import Lifecycle, Liveness
from leases.choices import LeaseState

from .client import Api
from .story import StepResult


def counts(api: Api, path: str, name: str, values, **params) -> dict[str, int]:
    """How many items of ``path`` have each value of the ``name`` filter (one small query each)."""
    found = {}
    for value in values:
        count = api.get(path, page_size=1, **{name: value}, **params)["count"]
        if count:
            found[value] = count
    return found


def summary(
    api: Api,
    results: list[StepResult],
    *,
    base_url: str,
    login: tuple[str, str],
    token: str,
    owner: tuple[str, str] | None = None,
) -> str:
    lines = ["", "=" * 78, "nodepool demo — summary", "=" * 78]
    for pool in api.all("/pools"):
        lifecycles = counts(api, "/nodes", "lifecycle", Lifecycle.values, pool=pool["name"])
        liveness = counts(api, "/nodes", "liveness", Liveness.values, pool=pool["name"])
        lines.append(f"pool {pool['name']:<12} {sum(lifecycles.values()):>4} nodes")
        lines.append(f"    lifecycle: {_fmt(lifecycles)}")
        lines.append(f"    liveness:  {_fmt(liveness)}")
    leases = counts(api, "/node-leases", "state", LeaseState.values)
    lines.append(f"leases: {_fmt(leases)}")
    lines.append("")
    for result in results:
        lines.append(f"  [{'PASS' if result.ok else 'FAIL'}] {result.name} ({result.seconds:.0f} s)")
        if not result.ok:
            lines.extend(f"         {line}" for line in result.lines)
    passed = sum(r.ok for r in results)
    lines.append(f"\n{passed}/{len(results)} steps passed")
    lines += [
        "",
        f"admin:     {base_url}/admin/   (user {login[0]}, password {login[1]})",
        *(
            [
                f"owner:     {base_url}/admin/   (user {owner[0]}, password {owner[1]}: their nodes, usage, "
                "statements, appeals)"
            ]
            if owner
            else []
        ),
        f"overview:  {base_url}/admin/fleet-overview/   (per pool: capacity, can serve N now, guard, events)",
        f'metrics:   curl -H "Authorization: Bearer $(cat {_metrics_token_file()})" {base_url}/metrics',
        f"events:    curl -H 'Authorization: Token {token}' {base_url}/api/v1/events",
        f"API docs:  {base_url}/api/docs/",
        f"API:       curl -H 'Authorization: Token {token}' {base_url}/api/v1/nodes",
        "=" * 78,
    ]
    return "\n".join(lines)


def _fmt(found: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in found.items()) or "none"


def _metrics_token_file() -> str:
    """Where the demo's /metrics token is (var/metrics_token unless NODEPOOL_METRICS_TOKEN is set)."""
    return str(settings.VAR_DIR / "metrics_token") if (settings.VAR_DIR / "metrics_token").exists() else "<token>"
