"""Every alert has a runbook, every runbook an alert, and the rules name only label values the
metrics really export (docs/runbooks.md says what a new alert needs)."""

from __future__ import annotations

import itertools
import re

import pytest
import yaml
from django.utils import timezone

from fleet import fleet_state
from fleet.choices import Health, Lifecycle, Liveness
from fleet.models import Node
from tests.factories import NodeFactory, PoolFactory
from tests.metrics_support import samples, scrape
from tests.processes import ROOT

PROMETHEUS = ROOT / "deploy" / "prometheus"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
PARTS = ("What it means", "How to confirm", "What to do")
SELECTOR = re.compile(r"\b(nodepool_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def alert_rules() -> list[dict]:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"] if "alert" in rule]


def runbook_sections() -> dict[str, str]:
    """``{section title: its text}`` for every ``## `` section of docs/runbooks.md."""
    text = RUNBOOKS.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def anchor(title: str) -> str:
    """The anchor GitHub and most Markdown renderers give a heading."""
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def test_every_alert_links_its_runbook_section_and_every_section_has_an_alert():
    sections = runbook_sections()
    anchors = {anchor(title): title for title in sections}
    names = set()
    for rule in alert_rules():
        name = rule["alert"]
        names.add(name)
        url = rule["annotations"].get("runbook_url", "")
        assert url == f"docs/runbooks.md#{anchor(name)}", f"{name}: runbook_url {url!r}"
        assert anchors.get(anchor(name)) == name, f"{name}: no '## {name}' section in docs/runbooks.md"
        body = sections[name]
        for part in PARTS:
            section = re.search(rf"^### {part}\n(.+?)(?=^### |\Z)", body, flags=re.MULTILINE | re.DOTALL)
            assert section and section.group(1).strip(), f"{name}: its runbook lacks '### {part}'"
    assert set(sections) == names, f"runbook sections without an alert: {sorted(set(sections) - names)}"


def test_every_alert_fires_in_a_promtool_test_with_its_runbook_url():
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    fired = {}
    for case in (case for test in tests for case in test.get("alert_rule_test", [])):
        for alert in case.get("exp_alerts") or []:
            fired.setdefault(case["alertname"], []).append(alert.get("exp_annotations", {}).get("runbook_url"))
    for rule in alert_rules():
        urls = fired.get(rule["alert"])
        assert urls, f"{rule['alert']}: no promtool test sees it fire"
        assert set(urls) == {rule["annotations"]["runbook_url"]}, rule["alert"]


def named_label_values() -> set[tuple[str, str, str]]:
    """``(metric, label, value)`` for every equality or alternation matcher of the rules."""
    named = set()
    for rule in alert_rules():
        for metric, matchers in SELECTOR.findall(rule["expr"]):
            for label, op, value in MATCHER.findall(matchers):
                if op in ("=", "=~"):
                    named.update((metric, label, v) for v in value.split("|"))
    return named


def test_the_matcher_parser_reads_the_unreachable_rule():
    assert ("nodepool_nodes", "lifecycle", "ready") in named_label_values()
    assert ("nodepool_nodes", "liveness", "lost") in named_label_values()


@pytest.mark.django_db
def test_every_label_value_the_rules_name_is_exported(client):
    """One node in every lifecycle x liveness x health the database can hold: whatever the rules
    name must then appear on /metrics (a lifecycle that no longer exists, like ``cordoned``, cannot)."""
    pool = PoolFactory(name="general")
    now = timezone.now()
    for lifecycle, liveness, health in itertools.product(Lifecycle.values, Liveness.values, Health.values):
        if lifecycle == Lifecycle.RETIRED:
            continue  # not counted by nodepool_nodes
        node = NodeFactory(pool=pool)
        Node.objects.filter(pk=node.pk).update(
            lifecycle=lifecycle, liveness=liveness, health=health, last_heartbeat_at=now
        )
    # Devices in every health, allocatable or not, and an open quarantine of every rule.
    from fleet.choices import DeviceHealth
    from fleet.models import Device
    from maintenance.choices import QuarantineRule
    from maintenance.models import Quarantine

    holder = NodeFactory(pool=pool)
    for i, (health, verified) in enumerate(itertools.product(DeviceHealth.values, (True, False))):
        Device.objects.create(
            node=holder, device_id=f"GPU-{i}", type="nvidia.com/gpu", index=i, model="NVIDIA H100 80GB HBM3",
            health=health, verified_at=now if verified else None, first_seen_at=now, last_seen_at=now,
        )  # fmt: skip
    for rule in QuarantineRule.values:  # one open quarantine per node
        Quarantine.objects.create(
            node=NodeFactory(pool=pool), rule=rule, reason=rule, from_state="ready", actor_type="system"
        )
    fleet_state.refresh(now=now)
    exported: dict[tuple[str, str], set[str]] = {}
    for (name, labels), _value in samples(scrape(client)).items():
        for label, value in labels:
            exported.setdefault((name, label), set()).add(value)
    missing = [
        (metric, label, value)
        for metric, label, value in sorted(named_label_values())
        if value not in exported.get((metric, label), set())
    ]
    assert not missing, f"the rules name label values /metrics never exports: {missing}"
