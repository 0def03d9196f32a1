"""Kubernetes node import, checked against the real cluster dumps in ../shared/fixtures/k8s-nodes.

Expected values are computed from the parsed source files (with an independent quantity parser),
never hard-coded, and every fixture file is imported.
"""

import io
import json
import re
from decimal import Decimal
from pathlib import Path

import pytest
import yaml
from django.core.management import CommandError, call_command

from fleet import event_types as fleet_events
from fleet.choices import Lifecycle
from fleet.events import Actor
from fleet.k8s_import import ImportError_, import_nodes, map_node
from fleet.models import Node, NodeEvent
from tests.factories import PoolFactory, set_lifecycle
from tests.races import race


def _fixtures_dir() -> Path:
    """``../shared/fixtures/k8s-nodes`` from the repository root (or from a parent, for worktrees)."""
    root = Path(__file__).resolve().parents[2]
    for base in [root, *root.parents]:
        candidate = base.parent / "shared" / "fixtures" / "k8s-nodes"
        if candidate.is_dir():
            return candidate
    pytest.fail(f"the Kubernetes node fixtures are missing: expected {root.parent / 'shared/fixtures/k8s-nodes'}")


FIXTURES = _fixtures_dir()
FILES = sorted(p.name for p in FIXTURES.iterdir() if p.suffix in (".json", ".yaml", ".yml"))
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "": 1}


def _source(name: str) -> list[dict]:
    text = (FIXTURES / name).read_text()
    doc = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    return doc.get("items", [doc])


def _expected_amount(resource: str, quantity: str) -> int:
    """An independent reading of the quantities that occur in the fixtures."""
    if resource == "cpu":
        return int(quantity[:-1]) if quantity.endswith("m") else int(Decimal(quantity) * 1000)
    number, suffix = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()
    return int(number) * UNITS[suffix]


def _mappable(resource: str) -> bool:
    return (
        resource in {"cpu", "memory", "ephemeral-storage", "pods"}
        or resource.startswith("hugepages-")
        or ("/" in resource)
    )


@pytest.fixture
def pool(db):
    return PoolFactory(name="imported")


def _import(name, pool, **kwargs):
    return import_nodes(text=(FIXTURES / name).read_text(), pool=pool, actor=Actor.system("test"), **kwargs)


def test_every_fixture_file_is_there():
    assert len(FILES) == 5


@pytest.mark.parametrize("name", FILES)
def test_every_node_of_every_dump_becomes_a_pending_node_with_the_sources_values(name, pool):
    report = _import(name, pool)
    source = _source(name)

    assert sorted(report.created) == sorted(item["metadata"]["name"] for item in source)
    for item in source:
        meta, status, spec = item["metadata"], item["status"], item.get("spec", {})
        node = Node.objects.get(external_id=f"k8s:{meta['uid']}")
        assert node.pool == pool
        assert node.lifecycle == Lifecycle.PENDING
        assert node.display_name == meta["name"]
        assert node.labels == meta.get("labels", {})
        assert node.taints == [
            {"key": t["key"], "value": t.get("value", ""), "effect": t["effect"]} for t in spec.get("taints", [])
        ]
        hostnames = [a["address"] for a in status["addresses"] if a["type"] == "Hostname"]
        assert node.hostname == (hostnames[0] if hostnames else meta["name"])
        assert node.addresses == [a["address"] for a in status["addresses"] if a["type"] != "Hostname"]
        for section, key in (("capacity", "resources"), ("allocatable", "allocatable")):
            expected = {r: _expected_amount(r, q) for r, q in status[section].items() if _mappable(r)}
            assert node.declared[key] == expected, section
        info = status["nodeInfo"]
        features = node.declared["features"]
        assert features["arch"] == info["architecture"]
        assert features["os"] == info["operatingSystem"]
        assert features["kernel"] == info["kernelVersion"]
        assert features["runtimes"] == [info["containerRuntimeVersion"].split("://")[0]]
        assert set(features) == {"arch", "os", "kernel", "runtimes", "network_class", "services"}
        assert [(c["type"], c["status"], c["reason"]) for c in node.conditions] == [
            (c["type"], c["status"], c.get("reason", "")) for c in status["conditions"]
        ]
        source_ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert node.ready is False and f"Ready={source_ready['status']}" in node.ready_reason
        gpus = int(status["capacity"].get("nvidia.com/gpu", 0))
        if gpus:
            (accelerator,) = node.declared["accelerators"]
            labels = meta.get("labels", {})
            assert accelerator["count"] == gpus
            assert accelerator["model"] == labels.get("nvidia.com/gpu.product", "")
            assert accelerator["memory"] == int(labels.get("nvidia.com/gpu.memory", 0)) * 2**20
        else:
            assert node.declared["accelerators"] == []
        event = NodeEvent.objects.get(node=node, type=fleet_events.ENROLLED)  # devices have events of their own
        assert event.type == fleet_events.ENROLLED and event.data["uid"] == meta["uid"]
        assert event.data["node_info"]["os_image"] == info["osImage"]
        assert event.data["node_info"]["kubelet_version"] == info["kubeletVersion"]
        assert event.data["node_info"]["container_runtime_version"] == info["containerRuntimeVersion"]
        assert event.data["node_info"]["provider_id"] == spec.get("providerID", "")


@pytest.mark.parametrize("name", FILES)
def test_what_could_not_be_mapped_is_reported(name, pool):
    report = _import(name, pool)

    for item in _source(name):
        notes = report.unmapped[item["metadata"]["name"]]
        unknown = [r for r in item["status"]["capacity"] if not _mappable(r)]
        for resource in unknown:
            assert any(n.startswith(f"capacity.{resource}=") for n in notes)
        annotations = item["metadata"].get("annotations", {})
        if annotations:
            assert f"{len(annotations)} annotations ignored" in notes
        if int(item["status"]["capacity"].get("nvidia.com/gpu", 0)) and "nvidia.com/gpu.product" not in item[
            "metadata"
        ].get("labels", {}):
            assert any("without GPU feature discovery labels" in n for n in notes)


@pytest.mark.parametrize("name", FILES)
def test_importing_the_same_dump_again_changes_nothing(name, pool):
    _import(name, pool)
    nodes, events = Node.objects.count(), NodeEvent.objects.count()

    again = _import(name, pool)

    assert again.created == [] and again.updated == []
    assert sorted(again.unchanged) == sorted(i["metadata"]["name"] for i in _source(name))
    assert (Node.objects.count(), NodeEvent.objects.count()) == (nodes, events)


def test_a_changed_node_is_updated_in_place_and_its_lifecycle_kept(pool):
    _import("nodelist-2-notready-kubeadm.yaml", pool)
    source = yaml.safe_load((FIXTURES / "nodelist-2-notready-kubeadm.yaml").read_text())
    node1 = source["items"][0]
    target = Node.objects.get(external_id=f"k8s:{node1['metadata']['uid']}")
    set_lifecycle(target, Lifecycle.MAINTENANCE)  # (cordoned is a hold now, not a lifecycle)
    node1["metadata"]["labels"]["rack"] = "r12"
    node1["spec"]["taints"] = []

    report = import_nodes(text=yaml.safe_dump(source), pool=pool, actor=Actor.system("test"))

    target.refresh_from_db()
    assert report.updated == ["node1"] and report.unchanged == ["node2"]
    assert target.labels["rack"] == "r12" and target.taints == []
    assert target.lifecycle == Lifecycle.MAINTENANCE
    assert target.version == 2
    event = NodeEvent.objects.filter(node=target, type=fleet_events.POLICY).get()
    assert sorted(event.data["changed"]) == ["labels", "taints", "taints_added_at"]
    assert target.taints_added_at == {}


def test_a_node_imported_into_another_pool_is_not_moved(pool):
    _import("gpu-node-8x-nvidia-k3s.json", pool)
    other = PoolFactory(name="elsewhere")

    report = _import("gpu-node-8x-nvidia-k3s.json", other)

    assert report.created == [] and len(report.skipped) == 1 and "not moved" in report.skipped[0]
    assert Node.objects.get().pool == pool


def test_a_dry_run_creates_nothing(pool):
    report = _import("nodelist-3-workers-aks.json", pool, dry_run=True)
    assert len(report.created) == 3
    assert Node.objects.count() == 0


def test_a_node_without_uid_is_skipped_and_the_rest_imported(pool):
    source = json.loads((FIXTURES / "nodelist-3-workers-aks.json").read_text())
    del source["items"][1]["metadata"]["uid"]

    report = import_nodes(text=json.dumps(source), pool=pool, actor=Actor.system("test"))

    assert len(report.created) == 2 and len(report.skipped) == 1
    assert "metadata.uid" in report.skipped[0]


def test_input_that_is_not_kubernetes_nodes_is_refused(pool):
    with pytest.raises(ImportError_, match="no Node objects"):
        import_nodes(text='{"kind": "PodList", "items": []}', pool=pool, actor=Actor.system("test"))
    with pytest.raises(ImportError_, match="not JSON or YAML"):
        import_nodes(text="{: nope", pool=pool, actor=Actor.system("test"))
    assert Node.objects.count() == 0


def test_non_node_items_of_a_list_are_skipped_with_a_note(pool):
    source = json.loads((FIXTURES / "gpu-node-a16-vgpu-rke2.json").read_text())
    source["items"].append({"kind": "Pod", "metadata": {"name": "p"}})

    report = import_nodes(text=json.dumps(source), pool=pool, actor=Actor.system("test"))

    assert report.created == ["gpu-node-1"]
    assert report.notes == ["items[1]: skipped an object of kind Pod"]


def test_unknown_taint_effects_and_bad_quantities_are_reported_not_imported():
    item = _source("nodelist-2-notready-kubeadm.yaml")[0]
    item["spec"]["taints"].append({"key": "x", "effect": "Sometimes"})
    item["status"]["capacity"]["memory"] = "lots"

    mapped = map_node(item)

    assert all(t["effect"] != "Sometimes" for t in mapped.fields["taints"])
    assert "memory" not in mapped.fields["declared"]["resources"]
    assert any(n.startswith("capacity.memory='lots'") for n in mapped.unmapped)
    assert any("Sometimes" in n for n in mapped.unmapped)


def test_the_command_imports_files_and_stdin_and_prints_the_report(pool, monkeypatch):
    out = io.StringIO()
    call_command("import_k8s_nodes", str(FIXTURES / "nodelist-3-workers-aks.json"), "--pool", pool.name, stdout=out)
    text = out.getvalue()
    assert "3 created, 0 updated, 0 unchanged, 0 skipped" in text
    assert "attachable-volumes-azure-disk=4: not a resource nodepool places work on" in text

    monkeypatch.setattr("sys.stdin", io.StringIO((FIXTURES / "nodelist-2-notready-kubeadm.yaml").read_text()))
    out = io.StringIO()
    call_command("import_k8s_nodes", "-", "--pool", pool.name, "--json", stdout=out)
    assert sorted(json.loads(out.getvalue())["-"]["created"]) == ["node1", "node2"]
    assert Node.objects.count() == 5


def test_the_command_refuses_an_unknown_pool_or_file(pool):
    with pytest.raises(CommandError, match="no pool named"):
        call_command("import_k8s_nodes", str(FIXTURES / FILES[0]), "--pool", "nope")
    with pytest.raises(CommandError, match="No such file"):
        call_command("import_k8s_nodes", "/nonexistent.json", "--pool", pool.name)
    with pytest.raises(CommandError, match="not JSON or YAML"):
        call_command("import_k8s_nodes", str(FIXTURES / "README.md"), "--pool", pool.name)


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_concurrent_imports_of_the_same_dump_create_each_node_once():
    pool = PoolFactory(name="concurrent")
    text = (FIXTURES / "nodelist-openshift-gcp-3-masters-3-workers.json").read_text()
    outcome = race(lambda index: import_nodes(text=text, pool=pool, actor=Actor.system("test")), 4)

    assert outcome.errors == []
    assert Node.objects.count() == 6
    assert NodeEvent.objects.filter(type=fleet_events.ENROLLED).count() == 6


def test_a_taints_time_added_comes_from_the_dump_where_it_has_one(pool, time_machine):
    time_machine.move_to("2026-11-30T06:00:00Z", tick=False)
    source = yaml.safe_load((FIXTURES / "nodelist-2-notready-kubeadm.yaml").read_text())
    node1 = source["items"][0]
    # As the node lifecycle controller writes it: a NoExecute taint with its timeAdded.
    node1["spec"]["taints"].append(
        {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": "2026-11-30T05:50:00Z"}
    )
    without_time = [t for t in node1["spec"]["taints"] if "timeAdded" not in t]

    import_nodes(text=yaml.safe_dump(source), pool=pool, actor=Actor.system("test"))

    target = Node.objects.get(external_id=f"k8s:{node1['metadata']['uid']}")
    assert target.taints_added_at["node.kubernetes.io/unreachable:NoExecute"] == "2026-11-30T05:50:00+00:00"
    for taint in without_time:  # no timeAdded in the dump: added when imported
        assert target.taints_added_at[f"{taint['key']}:{taint['effect']}"] == "2026-11-30T06:00:00+00:00"

    time_machine.shift(3600)
    again = import_nodes(text=yaml.safe_dump(source), pool=pool, actor=Actor.system("test"))
    assert "node1" in again.unchanged, "a re-import keeps the recorded times"


def test_a_malformed_time_added_is_reported_and_the_import_time_used(pool):
    item = _source("nodelist-2-notready-kubeadm.yaml")[0]
    item["spec"]["taints"].append({"key": "k", "effect": "NoExecute", "timeAdded": "yesterday"})

    mapped = map_node(item)

    assert "k:NoExecute" not in mapped.taints_added
    assert any("timeAdded 'yesterday'" in note for note in mapped.unmapped)
