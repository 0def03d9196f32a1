"""The condition-to-schedulability table of docs/heartbeats.md, row by row.

Each row puts one dimension of an otherwise schedulable node into one state — conditions arrive
through the heartbeat service, so health is judged by the real policy — and checks both halves of
the rule: the SQL filter placement uses (``schedulable_nodes``) and the reasons the API shows
(``unschedulable_reasons``). Issue 12, case 4: ``Ready=Unknown`` is not schedulable.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.utils import timezone

from fleet.choices import Lifecycle, Liveness
from fleet.credentials import revoke_all_credentials
from fleet.models import Node
from fleet.selectors import schedulable_nodes, unschedulable_reasons
from maintenance.holds import place_hold
from tests.factories import make_schedulable_node, set_lifecycle
from tests.heartbeat_support import send

pytestmark = pytest.mark.django_db
DOC = Path(__file__).resolve().parents[2] / "docs" / "heartbeats.md"


def ready(status: str, **extra) -> list[dict]:
    conditions = [{"type": "Ready", "status": status, "reason": "Test", "message": ""}]
    return conditions + [{"type": t, "status": s, "reason": "", "message": ""} for t, s in extra.items()]


def report(node: Node, **fields) -> None:
    send(node, sequence=Node.objects.get(pk=node.pk).sequence + 1, **fields)


def baseline(node):
    report(node, conditions=ready("True"))


def lifecycle(node):
    baseline(node)
    set_lifecycle(node, Lifecycle.MAINTENANCE)


def hold(node):
    baseline(node)
    place_hold(node, "user:olivia", "hardware check")


def silent(node):
    baseline(node)
    Node.objects.filter(pk=node.pk).update(liveness=Liveness.UNREACHABLE)


def reports_not_ready(node):
    report(node, conditions=ready("True"), ready=False, ready_reason="draining its own queue")


def ready_false(node):
    report(node, conditions=ready("False"))


def ready_unknown(node):
    report(node, conditions=ready("Unknown"))


def ready_absent(node):
    report(node, conditions=[{"type": "MemoryPressure", "status": "False", "reason": "", "message": ""}])


def unhealthy_condition(node):
    report(node, conditions=ready("True", MemoryPressure="True"))


def degraded_condition(node):
    report(node, conditions=ready("True", DiskPressure="Unknown"))


def never_reported(node):
    Node.objects.filter(pk=node.pk).update(health="unknown", health_reasons=[], conditions=[])


def status_report_overdue(node):
    """Renewals keep it alive, but its last status report is more than two intervals old: the sweep marks it."""
    from datetime import timedelta

    from fleet.events import Actor
    from fleet.status_reports import mark_overdue

    baseline(node)
    later = timezone.now() + timedelta(seconds=121)
    assert mark_overdue(now=later, actor=Actor.system("test")) == 1


def no_credential(node):
    baseline(node)
    revoke_all_credentials(node=node, now=timezone.now())


ROWS = {
    "baseline": (baseline, []),
    "lifecycle": (lifecycle, ["lifecycle_not_ready"]),
    "hold": (hold, ["cordoned"]),
    "silent": (silent, ["not_alive"]),
    "reports_not_ready": (reports_not_ready, ["node_not_ready"]),
    "ready_false": (ready_false, ["ready_condition_false"]),
    "ready_unknown": (ready_unknown, ["ready_condition_unknown"]),
    "ready_absent": (ready_absent, []),
    "unhealthy_condition": (unhealthy_condition, ["unhealthy"]),
    "degraded_condition": (degraded_condition, []),
    "never_reported": (never_reported, ["unhealthy"]),
    "status_report_overdue": (status_report_overdue, ["status_report_overdue"]),
    "no_credential": (no_credential, ["no_valid_credential"]),
}


def documented_rows() -> dict[str, tuple[bool, list[str]]]:
    """``{row: (schedulable, [codes])}`` from the table in docs/heartbeats.md."""
    text = DOC.read_text()
    section = text[text.index("### Condition-to-schedulability table") :]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| `(\w+)` \|.*\| (yes|no)\b[^|]*\| (.+) \|$", line)
        if match:
            rows[match.group(1)] = (match.group(2) == "yes", re.findall(r"`(\w+)`", match.group(3)))
    return rows


def test_the_documented_table_and_these_tests_list_the_same_rows_and_codes():
    documented = documented_rows()

    assert set(documented) == set(ROWS)
    for name, (schedulable, codes) in documented.items():
        assert (schedulable, codes) == (not ROWS[name][1], ROWS[name][1]), name


@pytest.mark.parametrize("row", list(ROWS))
def test_each_row_of_the_table(row):
    node, _ = make_schedulable_node()
    setup, codes = ROWS[row]

    setup(node)

    node = Node.objects.get(pk=node.pk)
    assert [r["code"] for r in unschedulable_reasons(node)] == codes
    assert schedulable_nodes().filter(pk=node.pk).exists() is (not codes)


def test_ready_unknown_reported_in_a_heartbeat_gets_no_lease(client_api):
    node, secret = make_schedulable_node()
    ready_unknown(node)

    response = client_api.post(
        "/api/v1/node-leases",
        {"workload_id": "job-1", "pool": node.pool.name, "resources": {"cpu": "500m"}, "ttl_seconds": 60},
        format="json",
    )

    assert response.status_code == 409
    assert response.json()["reasons"] == {"ready_condition_unknown": 1}
    node.refresh_from_db()
    assert (node.health, node.health_reasons) == ("unknown", ["Ready=Unknown (Test)"])
