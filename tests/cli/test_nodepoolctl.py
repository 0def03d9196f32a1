"""nodepoolctl against a live test server (pytest-django's live_server: real HTTP through httpx)."""

from __future__ import annotations

import json
import re
import subprocess
from datetime import timedelta

import click
import pytest
import yaml
from click.testing import CliRunner
from django.utils import timezone

from fleet.models import Node
from leases.models import Lease
from maintenance.models import Drain, Quarantine
from nodepool.tokens import create_user_token
from nodepoolctl.cli import cli
from nodepoolctl.config import ConfigError, load_config
from tests.factories import PoolFactory, make_schedulable_node, place_test_hold
from tests.maintenance_support import make_lease
from tests.processes import VENV_BIN


@pytest.fixture
def ctl(live_server, operator, monkeypatch, tmp_path):
    """Run nodepoolctl as the operator against the live server; returns (exit code, stdout, stderr)."""
    _, token = create_user_token(operator)
    # No config file: the default place (under XDG_CONFIG_HOME) may be absent; a named one may not.
    monkeypatch.delenv("NODEPOOLCTL_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "250")  # Rich tables: no wrapping of the columns under test

    def run(*args: str, token: str = token):
        result = CliRunner().invoke(cli, list(args), env={"NODEPOOL_URL": live_server.url, "NODEPOOL_TOKEN": token})
        return result.exit_code, result.stdout, result.stderr

    return run


@pytest.fixture
def fleet(db):
    gpu, general = PoolFactory(name="gpu"), PoolFactory(name="general")
    a, _ = make_schedulable_node(gpu, hostname="gpu-1", labels={"zone": "a", "accel": "a16"},
                                 resources={"cpu": 8000, "memory": 32 * 2**30, "nvidia.com/gpu": 2})  # fmt: skip
    b, _ = make_schedulable_node(general, hostname="cpu-1", labels={"zone": "b"})
    c, _ = make_schedulable_node(general, hostname="cpu-2", labels={"zone": "c"})
    return {"gpu-1": a, "cpu-1": b, "cpu-2": c}


def test_get_nodes_as_a_table_json_yaml_and_names(ctl, fleet):
    code, table, _ = ctl("get", "nodes")
    assert code == 0
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["NAME", "POOL", "STATUS"]
    assert {line.split()[0] for line in lines[1:]} == {"gpu-1", "cpu-1", "cpu-2"}

    assert {n["hostname"] for n in json.loads(ctl("get", "nodes", "-o", "json")[1])} == set(fleet)
    assert {n["hostname"] for n in yaml.safe_load(ctl("get", "nodes", "-o", "yaml")[1])} == set(fleet)
    assert sorted(ctl("get", "nodes", "-o", "name")[1].split()) == ["node/cpu-1", "node/cpu-2", "node/gpu-1"]
    wide = ctl("get", "nodes", "-o", "wide")[1]
    assert str(fleet["gpu-1"].pk) in wide and "accel=a16" in wide


def test_tables_in_a_pipe_keep_every_cell_whole_one_row_per_line(ctl, fleet, monkeypatch):
    """Output captured (not a terminal) and 40 columns: headers and ids were folded (``LIVENES``/``S``,
    an id over two lines). Now a cell is never folded: the default table leaves columns out to fit
    (the name and STATUS stay, whole), ``-o wide`` and ``watch`` in a pipe print every column whole."""
    long = "rack1-very-long-hostname-0001.example.internal"
    Node.objects.filter(pk=fleet["cpu-1"].pk).update(hostname=long, labels={"zone": "b", "rack": "r" * 30})
    monkeypatch.setenv("COLUMNS", "40")

    for args in (["get", "nodes"], ["get", "nodes", "-o", "wide"], ["watch", "nodes", "--count", "1", "-o", "wide"]):
        code, text, _ = ctl(*args)
        assert code == 0, args
        lines = [line for line in text.splitlines() if line.strip() and "node(s), every" not in line]
        assert len(lines) == 1 + len(fleet), (args, text)
        expected = ["NAME", "POOL", "STATUS", "LIVENESS"] if "-o" in args else ["NAME", "STATUS"]
        assert lines[0].split()[: len(expected)] == expected, args
        row = next(line for line in lines if line.startswith(long))
        if "-o" in args:
            assert str(fleet["cpu-1"].pk) in row and "rack=" + "r" * 30 in row, args

    code, text, _ = ctl("top", "pool")
    assert code == 0 and text.splitlines()[0].split()[:3] == ["POOL", "NODES", "SCHEDULABLE"]
    assert "MEMORY USED/ALLOC" in text.splitlines()[0] and len(text.splitlines()) == 3
    code, text, _ = ctl("describe", "node", str(fleet["cpu-1"].pk))
    assert code == 0 and long in text and str(fleet["cpu-1"].pk) in text and "r" * 30 in text


def test_at_80_columns_every_line_of_get_fits_and_no_name_is_cut(ctl, fleet, monkeypatch):
    Node.objects.filter(pk=fleet["cpu-2"].pk).update(hostname="worker-0042.rack-17.dc-east.example")
    place_test_hold(fleet["gpu-1"])
    make_lease(fleet["cpu-1"], "training-run-2026-12-02-resnet50")
    assert ctl("drain", "cpu-1", "--reason", "kernel upgrade", "--deadline", "2h")[0] == 0
    assert ctl("quarantine", "gpu-1", "--reason", "unexpected outbound traffic")[0] == 0
    monkeypatch.setenv("COLUMNS", "80")

    names = {"nodes": ["gpu-1", "cpu-1", "worker-0042.rack-17.dc-east.example"], "leases": [],
             "pools": ["gpu", "general"], "drains": [], "quarantines": [], "events": []}  # fmt: skip
    for kind, must in names.items():
        code, text, err = ctl("get", kind)
        assert code == 0 and text, (kind, err)
        assert all(len(line) <= 80 for line in text.splitlines()), (kind, text)
        assert all(name in text for name in must), (kind, text)
    for kind in ("leases", "drains", "quarantines"):  # ids (their names) whole
        listed = json.loads(ctl("get", kind, "-o", "json")[1])
        assert all(str(obj["id"]) in ctl("get", kind)[1] for obj in listed), kind
    events = ctl("get", "events")[1].splitlines()
    assert events[0].split()[:5] == ["LAST", "SEEN", "TYPE", "OBJECT", "MESSAGE"]  # BY left out, OBJECT kept
    assert any("node/gpu-1" in line for line in events)
    wide = ctl("get", "nodes", "-o", "wide")[1]
    assert max(map(len, wide.splitlines())) > 80 and "LIVENESS" in wide and "HEARTBEAT" in wide


def test_tables_name_nodes_by_name_not_by_id(ctl, fleet):
    node = fleet["cpu-1"]
    make_lease(node, "job-3")
    assert ctl("quarantine", "gpu-1", "--reason", "rootkit")[0] == 0
    for kind, name in (("leases", "cpu-1"), ("quarantines", "gpu-1"), ("events", "node/gpu-1")):
        text = ctl("get", kind)[1]
        assert name in text, (kind, text)
        assert str(node.pk) not in text and str(fleet["gpu-1"].pk) not in text, (kind, text)
    assert json.loads(ctl("get", "leases", "-o", "json")[1])[0]["node_id"] == str(node.pk)  # json unchanged


def test_get_events_newest_oldest_first_for_a_node_or_pool(ctl, fleet):
    place_test_hold(fleet["cpu-1"], "user:olivia", "bios update")
    code, text, _ = ctl("get", "events", "--node", "cpu-1")
    assert code == 0, text
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["LAST", "SEEN", "TYPE", "OBJECT"]
    assert all("node/cpu-1" in line for line in lines[1:]) and any("hold" in line for line in lines[1:])
    assert ctl("get", "events", "cpu-1", "-o", "json")[1] == ctl("get", "events", "--node", "cpu-1", "-o", "json")[1]
    assert len(json.loads(ctl("get", "events", "--limit", "1", "-o", "json")[1])) == 1
    code, _, stderr = ctl("get", "events", "--pool", "no-such-pool")
    assert code == 1 and stderr.startswith("error: 404")


def test_top_node_shows_reported_usage_and_allocation(ctl, fleet):
    make_lease(fleet["gpu-1"], "train", resources={"cpu": 2000, "nvidia.com/gpu": 1})
    Node.objects.filter(pk=fleet["gpu-1"].pk).update(usage={"cpu": 4000, "memory": 8 * 2**30})
    code, text, _ = ctl("top", "node")
    assert code == 0, text
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert text.splitlines()[0].split()[:5] == ["NAME", "CPU", "CPU%", "MEMORY", "MEMORY%"]
    assert rows["gpu-1"][1:5] == ["4", "50%", "8Gi", "25%"]
    assert rows["gpu-1"][5] == "25%" and rows["gpu-1"][-1] == "1"
    assert rows["cpu-1"][1] == "<unknown>"
    data = json.loads(ctl("top", "node", "gpu-1", "-o", "json")[1])
    assert data == [{"node": "gpu-1", "pool": "gpu", "gpu_free": 1,
                     "cpu": {"used": 4000, "allocated": 2000, "allocatable": 8000},
                     "memory": {"used": 8 * 2**30, "allocated": 0, "allocatable": 32 * 2**30}}]  # fmt: skip
    assert ctl("top", "node", "--pool", "nope")[0] == 1


def test_selectors_use_placements_labels_and_describe_marks_untrusted_ones(ctl, fleet):
    from fleet.models import Pool

    Node.objects.filter(pk=fleet["cpu-1"].pk).update(node_labels={"disk": "nvme"})
    Node.objects.filter(pk=fleet["gpu-1"].pk).update(node_labels={"disk": "nvme"})
    Pool.objects.filter(name="gpu").update(trust_node_labels=True)
    assert ctl("get", "nodes", "-l", "disk=nvme", "-o", "name")[1].split() == ["node/gpu-1"]
    assert ctl("get", "nodes", "-l", "nodepool.dev/pool=general,zone in (b,c,x),zone>1", "-o", "name")[1] == "\n"
    assert sorted(ctl("get", "nodes", "-l", "zone in (),!accel", "-o", "name")[1].split()) == []
    untrusted = next(
        line for line in ctl("describe", "node", "cpu-1")[1].splitlines() if line.startswith("Node labels")
    )
    assert "disk=nvme" in untrusted and "untrusted: pool general does not trust node labels" in untrusted
    trusted = next(line for line in ctl("describe", "node", "gpu-1")[1].splitlines() if line.startswith("Node labels"))
    assert "disk=nvme" in trusted and "untrusted" not in trusted


def test_a_lease_shows_the_placement_it_asked_for(ctl, fleet):
    lease = make_lease(fleet["cpu-1"], "job-p")
    Lease.objects.filter(pk=lease.pk).update(
        spec={
            "node_selector": {"zone": "b"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    )
    wide = ctl("get", "leases", "-o", "wide")[1]
    assert "PLACEMENT" in wide and "selector zone=b; tolerates gpu:NoSchedule" in wide


def test_get_nodes_by_selector_and_pool(ctl, fleet):
    assert ctl("get", "nodes", "-l", "zone in (a,b),!accel", "-o", "name")[1].split() == ["node/cpu-1"]
    assert sorted(ctl("get", "nodes", "--pool", "general", "-o", "name")[1].split()) == ["node/cpu-1", "node/cpu-2"]


def test_a_bad_selector_exits_non_zero_with_the_problem_in_one_line(ctl, fleet):
    code, stdout, stderr = ctl("get", "nodes", "-l", "zone in (a")
    assert code == 1 and stdout == ""
    assert stderr.startswith("error: 400 invalid_filter: label selector 'zone in (a'")
    assert len(stderr.strip().splitlines()) == 1


def test_get_pools_leases_drains_and_quarantines(ctl, fleet):
    make_lease(fleet["cpu-1"], "job-7")
    assert {line.split()[0] for line in ctl("get", "pools")[1].splitlines()[1:]} == {"gpu", "general"}
    # /pools refuses ?pool= (an unknown parameter): --pool names the one pool to show.
    assert {line.split()[0] for line in ctl("get", "pools", "--pool", "gpu")[1].splitlines()[1:]} == {"gpu"}
    assert "job-7" in ctl("get", "leases")[1]
    assert ctl("get", "drains")[0] == 0 and ctl("get", "quarantines", "-o", "json")[1].strip() == "[]"
    code, _, stderr = ctl("get", "widgets")
    assert code == 2 and "one of" in stderr


def test_describe_node_shows_sections_with_events_last(ctl, fleet):
    node = fleet["cpu-1"]
    place_test_hold(node, "user:olivia", "bios update")
    Node.objects.filter(pk=node.pk).update(
        conditions=[{"type": "Ready", "status": "True", "reason": "KubeletReady"},
                    {"type": "DiskPressure", "status": "False", "reason": "NoPressure"}])  # fmt: skip
    make_lease(node, "job-9")

    code, text, err = ctl("describe", "node", "cpu-1")

    assert code == 0, err
    order = [
        text.index(heading) for heading in ("Name:", "Conditions:", "Capacity:", "Cordon holds:", "Leases:", "Events:")
    ]
    assert order == sorted(order)
    assert text.index("KubeletReady") < text.index("NoPressure")
    assert "user:olivia" in text and "job-9" in text and "32Gi" in text
    assert "hold" in text[text.index("Events:") :]
    by_id = ctl("describe", "node", str(node.pk))[1]
    assert by_id.splitlines()[:2] == text.splitlines()[:2] and "Events:" in by_id


def test_describe_node_shows_the_reliability_record(ctl, fleet):
    from fleet.models import NodeReliabilityDay

    node = fleet["cpu-1"]
    Node.objects.filter(pk=node.pk).update(reliability=0.9)
    NodeReliabilityDay.objects.create(
        node=node, day=timezone.now().date(), observed_seconds=86400, up_seconds=43200, leases_completed=9,
        leases_lost_unreachable=1, device_faults={"GPU-0": 2},
    )  # fmt: skip
    code, text, _ = ctl("describe", "node", "cpu-1")
    assert code == 0, text
    section = text[text.index("Reliability:") : text.index("Cordon holds:")]
    assert "0.9000 (30 days)" in section and "lost_unreachable 1" in section and "GPU-0 x2" in section
    assert re.search(r"7d\s+0\.5000\s+9\s+1\s+0\.9000", section), section
    assert "unrated" in ctl("describe", "node", "cpu-2")[1]


def test_describe_pool_shows_budgets_windows_and_blocked_disruptions(ctl, fleet):
    from operations.disruption import record_blocked
    from operations.models import PoolOperations

    window = {"nodes": "0", "reasons": ["upgrade"], "schedule": "0 9 * * 1-5", "duration": "8h", "timezone": "UTC"}
    PoolOperations.objects.create(pool=fleet["cpu-1"].pool, disruption_budgets=[{"nodes": "10%"}, window])
    record_blocked(node=fleet["cpu-1"], reason="upgrade", owner="system:upgrade", now=timezone.now(),
                   blocker={"kind": "window", "detail": "blackout window: pool budget #1"})  # fmt: skip

    code, text, _ = ctl("describe", "pool", "general")

    assert code == 0, text
    order = [text.index(h) for h in ("Name:", "Disruption budgets:", "Allowed disruptions:", "Blocked disruptions:")]
    assert order == sorted(order)
    assert "0 9 * * 1-5 for 8h" in text and "scale_down" in text
    blocked = text[text.index("Blocked disruptions:") :]
    assert "cpu-1" in blocked and "blackout window: pool budget #1" in blocked


def test_describe_pool_shows_back_off_fallback_pools_and_consolidation(ctl, fleet):
    from fleet.models import Pool
    from operations.models import PoolOperations

    spare = Pool.objects.create(name="spare")
    PoolOperations.objects.create(
        pool=fleet["cpu-1"].pool, provider="simulated", max_nodes=5, consecutive_failures=3,
        backoff_until=timezone.now() + timedelta(minutes=4), fallback_pools=[spare.pk], consolidate_after=300,
    )  # fmt: skip
    code, text, _ = ctl("describe", "pool", "general")
    assert code == 0, text
    provisioning = text[text.index("Provisioning:") : text.index("Disruption budgets:")]
    assert "Consecutive failures" in provisioning and "3" in provisioning
    assert "spare" in provisioning and "empty nodes after 300s" in provisioning


def test_describe_pool_shows_drift_expiry_and_replacements(ctl, fleet):
    from fleet.models import Pool
    from operations import replacement_sweep
    from operations.models import NodeReplacement, PoolOperations

    pool = fleet["cpu-1"].pool
    PoolOperations.objects.create(pool=pool, expire_after=86400, termination_grace=3600)
    replacement_sweep.sweep_pool(pool=pool)
    Pool.objects.filter(pk=pool.pk).update(labels={"rack": "r7"})  # every node drifts
    replacement_sweep.sweep_pool(pool=Pool.objects.get(pk=pool.pk))
    assert NodeReplacement.objects.filter(pool=pool, reason="drift").exists()

    code, text, _ = ctl("describe", "pool", "general")

    assert code == 0, text
    order = [text.index(h) for h in ("Blocked disruptions:", "Drift and expiry:", "Drifted nodes:", "Replacements:")]
    assert order == sorted(order)
    section = text[text.index("Drift and expiry:") :]
    assert "86400s (spread per node)" in section and "3600s, then forced" in section
    assert "PoolShapeChanged" in section and "pool shape changed" in section
    assert "cpu-1" in section[section.index("Replacements:") :] and "drift" in section


def test_describe_pool_shows_the_repair_breaker_and_rules(ctl, fleet):
    from operations.models import PoolOperations

    PoolOperations.objects.create(
        pool=fleet["cpu-1"].pool,
        repair_rules=[{"condition": "Ready", "status": "False", "for": 600, "action": "reboot"}],
        repair_breaker_open=True,
        repair_breaker_since=timezone.now(),
        repair_breaker_detail="3 of 10 nodes unhealthy (30%), more than repair_max_unhealthy 20%",
    )
    code, text, _ = ctl("describe", "pool", "general")
    assert code == 0, text
    repair = text[text.index("Repair:") :]
    assert "OPEN since" in repair and "3 of 10 nodes unhealthy" in repair
    assert "Ready=False" in repair[repair.index("Repair rules:") :] and "reboot" in repair


def test_describe_node_shows_the_status_report_age_apart_from_the_renewal(ctl, fleet):
    now = timezone.now()
    Node.objects.filter(pk=fleet["cpu-1"].pk).update(
        last_heartbeat_at=now, last_status_report_at=now - timedelta(minutes=5)
    )
    text = ctl("describe", "node", "cpu-1")[1]
    line = next(line for line in text.splitlines() if line.startswith("Status report:"))
    assert "(5m" in line and "ago)" in line
    assert re.search(r"^Status report:\s+never\s*$", ctl("describe", "node", "cpu-2")[1], flags=re.MULTILINE)


def test_cordon_and_uncordon_are_holds_aware(ctl, fleet, operator):
    node = fleet["cpu-1"]
    assert ctl("cordon", "cpu-1", "--reason", "bios update")[1].strip() == "node/cpu-1 cordoned"
    node.refresh_from_db()
    assert node.cordoned and node.holds.get().owner == f"user:{operator.username}"

    place_test_hold(node, "user:olivia", "disk swap")
    assert ctl("uncordon", "cpu-1", "--reason", "done")[1].strip() == "node/cpu-1 still cordoned by user:olivia"
    code, _, stderr = ctl("uncordon", "cpu-1", "--reason", "done", "--owner", "user:olivia")
    assert code == 1 and stderr.startswith("error: 403 ")
    assert ctl("uncordon", "cpu-1", "--reason", "mine now", "--owner", "user:olivia", "--override")[1].strip() == (
        "node/cpu-1 uncordoned"
    )
    assert Node.objects.get(pk=node.pk).cordoned is False


def test_a_stale_expected_version_is_refused_and_force_rereads_it(ctl, fleet):
    node = fleet["cpu-2"]
    stale = str(node.version)
    Node.objects.filter(pk=node.pk).update(version=node.version + 1)  # someone acted meanwhile

    code, _, stderr = ctl("cordon", "cpu-2", "--reason", "r", "--expected-version", stale)
    assert code == 1 and stderr.startswith("error: 412 ")
    assert Node.objects.get(pk=node.pk).cordoned is False

    assert ctl("cordon", "cpu-2", "--reason", "r", "--expected-version", stale, "--force")[0] == 0
    assert Node.objects.get(pk=node.pk).cordoned is True


def test_drain_dry_run_changes_nothing_then_drain_with_a_relative_deadline(ctl, fleet):
    lease = make_lease(fleet["cpu-1"], "job-1")
    code, text, _ = ctl(
        "drain", "cpu-1", "--reason", "kernel", "--deadline", "2h", "--policy", "checkpoint", "--dry-run"
    )
    assert code == 0 and text.startswith("node/cpu-1 would drain (dry run): 1 lease(s)")
    assert f"lease {str(lease.pk)[:8]} of job-1: checkpoint, placeable elsewhere" in text
    assert not Drain.objects.exists()

    before = timezone.now()
    code, text, _ = ctl("drain", "cpu-1", "--reason", "kernel", "--deadline", "2h", "--policy", "checkpoint")
    assert code == 0 and text.startswith("node/cpu-1 draining")
    drain = Drain.objects.get()
    assert before + timedelta(minutes=119) < drain.deadline < timezone.now() + timedelta(minutes=121)
    assert ctl("drain", "cpu-2", "--reason", "x", "--deadline", "soon")[0] == 2


def test_drain_policies_are_the_apis(ctl, fleet):
    code, text, _ = ctl("drain", "cpu-2", "--reason", "retire", "--deadline", "1h", "--policy", "terminate")
    assert code == 0 and text.startswith("node/cpu-2 draining"), text
    assert Drain.objects.get().policy == "terminate"
    code, _, stderr = ctl("drain", "cpu-1", "--reason", "x", "--deadline", "1h", "--policy", "revoke")
    assert code == 2 and "'revoke' is not one of 'wait', 'checkpoint', 'terminate'" in stderr


def test_every_choice_option_offers_exactly_the_apis_values():
    """The class of drain --policy offering "revoke" (the API says terminate): each option whose
    values the API defines comes from nodepoolctl.choices, which must equal the server's choices."""
    from leases.choices import ReleaseOutcome
    from maintenance.choices import EvictionPolicy
    from nodepoolctl.choices import DRAIN_POLICIES, RELEASE_OUTCOMES

    assert list(DRAIN_POLICIES) == EvictionPolicy.values
    assert list(RELEASE_OUTCOMES) == ReleaseOutcome.values

    def choices(path: list[str], option: str) -> list[str]:
        command = cli
        for name in path:
            command = command.commands[name]
        param = next(p for p in command.params if p.name == option)
        return list(param.type.choices)

    assert choices(["drain"], "policy") == EvictionPolicy.values
    assert choices(["lease", "release"], "outcome") == ReleaseOutcome.values


def test_a_validation_error_prints_each_fields_message(ctl, fleet):
    code, stdout, stderr = ctl("drain", "cpu-1", "--reason", "x" * 2001, "--deadline", "1h")
    assert code == 1 and stdout == ""
    assert stderr.strip() == "error: 400 validation_error: reason: Ensure this field has no more than 2000 characters."
    code, _, stderr = ctl("drain", "cpu-1", "--reason", "x", "--deadline", "3650d")
    assert code == 1
    assert stderr.strip() == "error: 422 deadline_too_far: The drain deadline may be at most 2592000 seconds away."
    assert not Drain.objects.exists()


def test_a_time_without_an_offset_or_not_a_time_is_a_usage_error(ctl, fleet):
    for args in (
        ["cordon", "cpu-1", "--reason", "r", "--expires-at", "tomorrow"],
        ["cordon", "cpu-1", "--reason", "r", "--expires-at", "2026-12-01T06:00:00"],
        ["drain", "cpu-1", "--reason", "r", "--deadline", "2026-12-01T06:00:00"],
    ):
        code, stdout, stderr = ctl(*args)
        assert code == 2 and stdout == "", args
        assert "Invalid value for '--" in stderr and ("RFC 3339" in stderr or "UTC offset" in stderr), stderr
    assert "has no UTC offset" in ctl("cordon", "cpu-1", "--reason", "r", "--expires-at", "2026-12-01T06:00:00")[2]
    assert Node.objects.get(pk=fleet["cpu-1"].pk).cordoned is False
    later = (timezone.now() + timedelta(hours=1)).isoformat()
    assert ctl("cordon", "cpu-1", "--reason", "r", "--expires-at", later)[0] == 0


def test_problem_errors_become_one_line_of_field_messages():
    import httpx

    from nodepoolctl.client import _problem

    def problem(body: dict) -> str:
        return str(_problem(httpx.Response(400, json={"status": 400, **body})))

    errors = [{"field": "deadline_in", "code": "deadline_too_far", "message": "Too far away."},
              {"field": "", "code": "invalid", "message": "Something else."}]  # fmt: skip
    assert problem({"code": "validation_error", "detail": "Invalid input in: deadline_in.", "errors": errors}) == (
        "400 validation_error: deadline_in: Too far away.; Something else."
    )
    filtered = {"code": "invalid_filter", "detail": "Invalid filter.", "errors": errors[:1]}
    assert problem(filtered) == "400 invalid_filter: Invalid filter. (deadline_in: Too far away.)"
    assert problem({"code": "x", "detail": "d", "errors": {"a": "b"}}) == "400 x: d (a: b)"
    assert problem({"code": "invalid_filter", "detail": "label selector 'x': bad"}) == (
        "400 invalid_filter: label selector 'x': bad"
    )


def test_a_merged_code_is_matched_by_its_new_and_its_deprecated_name():
    import httpx

    from nodepoolctl.client import _problem

    errors = [{"field": "ttl_seconds", "code": "invalid_request", "message": "must be an integer"}]
    merged = {"code": "validation_error", "deprecated_code": "invalid_request", "detail": "ttl_seconds: x"}
    error = _problem(httpx.Response(400, json={"status": 400, **merged, "errors": errors}))
    assert str(error) == "400 validation_error: ttl_seconds: must be an integer"
    assert error.is_code("validation_error") and error.is_code("invalid_request") and not error.is_code("")
    older = _problem(
        httpx.Response(400, json={"status": 400, "code": "invalid_request", "detail": "d", "errors": errors})
    )
    assert str(older) == "400 invalid_request: ttl_seconds: must be an integer"  # a server before round 3


def test_quarantine_with_evidence_and_release(ctl, fleet):
    code, text, _ = ctl("quarantine", "gpu-1", "--reason", "rootkit", "--evidence", '{"hash": "ff"}')
    assert (code, text.strip()) == (0, "node/gpu-1 quarantined")
    assert Quarantine.objects.get().evidence == {"hash": "ff"}
    assert ctl("quarantine", "cpu-1", "--reason", "x", "--evidence", "[1]")[0] == 2
    assert ctl("release", "gpu-1", "--reason", "reimaged")[1].strip() == "node/gpu-1 released"
    assert Node.objects.get(pk=fleet["gpu-1"].pk).lifecycle == "pending"


def test_top_pool_sums_capacity_of_schedulable_nodes(ctl, fleet):
    make_lease(fleet["gpu-1"], "train", resources={"cpu": 2000, "nvidia.com/gpu": 1})
    rows = {row["pool"]: row for row in json.loads(ctl("top", "pool", "-o", "json")[1])}
    assert rows["gpu"]["cpu"] == {"allocatable": 8000, "allocated": 2000, "free": 6000}
    assert rows["gpu"]["nvidia.com/gpu"]["free"] == 1
    assert (rows["general"]["nodes"], rows["general"]["schedulable"]) == (2, 2)
    table = ctl("top", "pool")[1]
    assert "2/8" in table and "25%" in table


def test_lease_request_renew_and_release(ctl, fleet):
    code, text, _ = ctl("lease", "request", "--workload", "job-42", "--pool", "general", "--cpu", "500m",
                        "--memory", "256Mi", "--ttl", "120")  # fmt: skip
    assert code == 0 and "fencing token 1" in text
    lease = Lease.objects.get(workload_id="job-42")
    assert ctl("lease", "renew", str(lease.pk), "--ttl", "600")[0] == 0
    lease.refresh_from_db()
    assert lease.ttl_seconds == 600 or lease.expires_at > timezone.now() + timedelta(seconds=500)
    assert ctl("lease", "release", str(lease.pk), "--outcome", "cancelled")[0] == 0
    assert Lease.objects.get(pk=lease.pk).state == "released"
    code, _, stderr = ctl("lease", "request", "--workload", "big", "--pool", "general", "--cpu", "512")
    assert code == 1 and stderr.startswith("error: 409 unschedulable:")


def test_watch_nodes_redraws_the_list(ctl, fleet):
    code, text, _ = ctl("watch", "nodes", "--interval", "0.5", "--count", "2", "--pool", "gpu")
    assert code == 0 and "gpu-1" in text and "1 node(s)" in text


def test_without_a_valid_token_or_server_it_exits_non_zero_in_one_line(ctl, fleet, live_server):
    code, _, stderr = ctl("get", "nodes", token="not-a-token")
    assert code == 1 and stderr.startswith("error: 401 ") and len(stderr.strip().splitlines()) == 1
    result = CliRunner().invoke(cli, ["--url", "http://127.0.0.1:9", "--token", "x", "get", "nodes"])
    assert result.exit_code == 1 and result.stderr.startswith("error: cannot reach http://127.0.0.1:9/api/v1")


def test_config_comes_from_options_then_environment_then_the_file(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    path.write_text('url = "http://file:8000/"\ntoken = "from-file"\n')
    monkeypatch.setenv("NODEPOOLCTL_CONFIG", str(path))
    monkeypatch.delenv("NODEPOOL_URL", raising=False)
    monkeypatch.delenv("NODEPOOL_TOKEN", raising=False)
    assert (load_config().url, load_config().token) == ("http://file:8000", "from-file")
    monkeypatch.setenv("NODEPOOL_TOKEN", "from-env")
    assert load_config().token == "from-env"
    assert load_config(token="from-option").token == "from-option"
    path.write_text("url = [1]\n")
    with pytest.raises(ConfigError, match="url must be a string"):
        load_config()
    path.write_text("url = \n")
    with pytest.raises(ConfigError):
        load_config()


def test_a_config_file_named_but_missing_is_an_error(tmp_path, monkeypatch):
    missing = tmp_path / "missing.toml"
    monkeypatch.setenv("NODEPOOLCTL_CONFIG", str(missing))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config()
    result = CliRunner().invoke(cli, ["get", "nodes"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.startswith(f"error: {missing}: no such config file")
    # The default place may be absent: no file there is the defaults, not an error.
    monkeypatch.delenv("NODEPOOLCTL_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NODEPOOL_URL", raising=False)
    assert load_config().url == "http://127.0.0.1:8000"


def test_help_on_every_command_and_group():
    def walk(command: click.Command, path: list[str]) -> int:
        result = CliRunner().invoke(cli, [*path, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output, path
        subcommands = command.commands.items() if isinstance(command, click.Group) else []
        return 1 + sum(walk(sub, [*path, name]) for name, sub in subcommands)

    assert walk(cli, []) >= 17


def test_the_installed_console_script_runs_and_prints_completion():
    script = str(VENV_BIN / "nodepoolctl")
    for args in ([], ["drain"]):
        result = subprocess.run([script, *args, "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "Usage: nodepoolctl" in result.stdout, (args, result.stderr)
    bash = subprocess.run([script, "completion", "bash"], capture_output=True, text=True, timeout=60)
    assert bash.returncode == 0 and "_NODEPOOLCTL_COMPLETE=bash_complete" in bash.stdout


def test_get_devices_of_a_node_and_describe_shows_them(ctl, fleet):
    from tests.device_support import gpus, report_devices

    report_devices(fleet["gpu-1"], gpus(2, node="g"))
    code, table, err = ctl("get", "devices", "gpu-1")
    assert code == 0, err
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["ID", "TYPE", "INDEX"]
    assert [line.split()[0] for line in lines[1:]] == ["GPU-g-0000", "GPU-g-0001"]
    code, described, _ = ctl("describe", "node", "gpu-1")
    assert code == 0 and "Devices" in described and "nvidia.com/gpu" in described
    assert "FREE BY MODEL" in described
    code, wide, _ = ctl("get", "nodes", "-o", "wide")
    assert code == 0 and "FREE DEVICES" in wide.splitlines()[0]
    assert ctl("get", "devices")[0] != 0  # a node is needed


def test_status_reads_as_kubectls_each_fact_once(ctl, fleet):
    from fleet.choices import Liveness
    from tests.factories import place_test_hold

    Node.objects.filter(pk=fleet["cpu-2"].pk).update(liveness=Liveness.UNREACHABLE)
    place_test_hold(fleet["gpu-1"])
    code, table, _ = ctl("get", "nodes")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert table.splitlines()[0].split()[:5] == ["NAME", "POOL", "STATUS", "LIVENESS", "LIFECYCLE"]
    assert rows["cpu-1"][2:6] == ["Ready", "alive", "ready", "healthy"]
    assert rows["cpu-2"][2:6] == ["Unknown", "unreachable", "ready", "unknown"]
    assert rows["gpu-1"][2] == "Ready,SchedulingDisabled"


def test_an_unknown_pool_is_an_error_not_an_empty_list(ctl, fleet):
    code, stdout, stderr = ctl("get", "nodes", "--pool", "no-such-pool")
    assert code == 1 and stdout == ""
    assert stderr.startswith("error: 404")
    for args in (["watch", "nodes", "--pool", "nope", "--count", "1"], ["top", "node", "--pool", "nope"],
                 ["get", "events", "--pool", "nope"], ["get", "leases", "--pool", "nope"]):  # fmt: skip
        code, _, stderr = ctl(*args)
        assert code == 1 and stderr.startswith("error: 404"), args
    code, _, stderr = ctl("get", "leases", "--pool", "general")  # a known pool with nothing: rc 0
    assert code == 0 and "No resources found" in stderr


def test_describe_and_get_lines_carry_no_trailing_padding(ctl, fleet):
    for args in (("describe", "node", "cpu-1"), ("get", "nodes"), ("get", "nodes", "-o", "wide")):
        code, text, _ = ctl(*args)
        assert code == 0, args
        assert all(line == line.rstrip() for line in text.splitlines()), args


def test_bulk_cordon_uncordon_and_drain_by_selector(ctl, fleet):
    from operations.models import PoolOperations

    code, text, _ = ctl("cordon", "-l", "zone in (b,c)", "--reason", "bios", "--dry-run")
    assert code == 0
    assert text.splitlines() == ["node/cpu-1 would cordon", "node/cpu-2 would cordon",
                                 "2 node(s) matched (dry run): 2 would cordon"]  # fmt: skip
    assert not Node.objects.filter(cordoned=True).exists()
    code, _, stderr = ctl("cordon", "-l", "zone in (b,c)", "--reason", "bios")
    assert code == 2 and "--expect" in stderr  # a real bulk action says how many nodes it means
    code, _, stderr = ctl("cordon", "-l", "zone in (b,c)", "--reason", "bios", "--expect", "3")
    assert code == 1 and stderr.startswith("error: 409 bulk_count_mismatch: The selector matches 2 node(s), not the 3")
    code, _, stderr = ctl("cordon", "-l", "", "--reason", "bios", "--expect", "3")
    assert code == 1 and stderr.startswith("error: 400 empty_selector")
    assert ctl("cordon", "cpu-1", "-l", "zone=b", "--reason", "x")[0] == 2  # a NODE or -l, not both

    code, text, _ = ctl("cordon", "-l", "zone in (b,c)", "--reason", "bios", "--expect", "2")
    assert code == 0 and text.splitlines()[-1] == "2 node(s) matched: 2 cordoned"
    assert Node.objects.filter(cordoned=True).count() == 2
    code, text, _ = ctl("uncordon", "-l", "zone in (b,c)", "--reason", "done", "--expect", "2")
    assert code == 0 and text.splitlines()[-1] == "2 node(s) matched: 2 uncordoned"

    PoolOperations.objects.create(pool=fleet["cpu-1"].pool, disruption_budgets=[{"nodes": "1"}])
    code, text, stderr = ctl("drain", "-l", "zone in (b,c)", "--reason", "kernel", "--deadline", "1h", "--expect", "2")
    assert code == 1, text
    assert text.splitlines()[-1] == "2 node(s) matched: 1 blocked, 1 draining"
    assert "blocked: " in text and stderr.strip() == "error: 1 of 2 node(s) not drained"
    assert Drain.objects.count() == 1
