"""Import Kubernetes Node objects (``kubectl get nodes -o json|yaml``) as pending nodepool nodes.

Mapping (Kubernetes → nodepool):

* ``metadata.uid`` → ``Node.external_id = "k8s:<uid>"``: the key that makes re-imports idempotent;
* ``metadata.name`` → ``display_name``; the ``Hostname`` address (else the
  ``kubernetes.io/hostname`` label, else the name) → ``hostname``; the other addresses → ``addresses``;
* ``metadata.labels`` → ``labels`` (platform labels: they were set by the cluster's operators
  and kubelets, not self-declared through our API); ``spec.taints`` → ``taints``;
* ``status.capacity`` → ``declared.resources`` and ``status.allocatable`` →
  ``declared.allocatable``, both in canonical units (:mod:`nodepool.quantity`): cpu, memory,
  ephemeral-storage, pods, hugepages-* and domain-qualified extended resources (``nvidia.com/gpu``);
* GPU resources (``<vendor>/gpu``) with the GPU feature discovery labels ``nvidia.com/gpu.product``
  and ``nvidia.com/gpu.memory`` (MiB) → ``declared.accelerators``;
* ``status.nodeInfo`` → ``declared.features`` (``arch``, ``os``, ``kernel``, ``runtimes`` from
  ``containerRuntimeVersion``): the contract's feature keys and no others, because enrollment
  refuses unknown features; the rest of nodeInfo (osImage, the runtime and kubelet versions),
  ``spec.providerID`` and ``status.runtimeHandlers`` are kept in the import event's data;
* ``status.conditions`` → ``conditions`` (type, status, reason, message, last_transition_time);
* count-only device resources (``<vendor>/gpu``, ``nvidia.com/mig-<profile>``, ``habana.ai/gaudi``)
  → one :class:`fleet.models.Device` per unit with a **synthetic id**
  ``k8s-<uid>/<resource>/<i>`` (:func:`synthetic_devices`; model and memory from the GPU feature
  discovery labels where present), **unverified**: admission does not verify them (an agent's
  real devices do), only an operator's "verify device" or an agent taking the node over does --
  its report of real devices retires the synthetic rows (``declared.synthetic``)
  (fleet.devices.apply_report). A re-import never reports synthetic devices over real ones.

Readiness stays false (``ready`` is the node's own word in a heartbeat; Kubernetes' ``Ready``
condition is kept among the conditions) and the lifecycle is ``pending``: an imported node
goes through admission like any other. Everything that is not mapped is reported per node.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from nodepool.quantity import QuantityError, to_canonical

from . import event_types
from . import taints as taint_times
from .choices import Lifecycle
from .devices import apply_report, parse_devices
from .events import Actor, record_event
from .models import Device, Node, Pool

EXTERNAL_PREFIX = "k8s:"
TAINT_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
BASE_RESOURCES = {"cpu", "memory", "ephemeral-storage", "pods"}
ADDRESS_TYPES = ("InternalIP", "ExternalIP", "InternalDNS", "ExternalDNS")
# Sections of a Node that nodepool has no place for; reported when present.
IGNORED_STATUS = ("images", "daemonEndpoints", "config", "volumesInUse", "volumesAttached", "phase", "features")
IGNORED_SPEC = ("podCIDR", "podCIDRs", "configSource", "externalID")
MIB = 2**20
# Extended resources that are devices (each unit one device); ``nvidia.com/mig-3g.20gb`` is MIG.
DEVICE_RESOURCE = re.compile(r"^(?:[a-z0-9.-]+/gpu|habana\.ai/gaudi|nvidia\.com/mig-(?P<profile>[0-9a-z.+]+))$")
SYNTHETIC_PREFIX = "k8s-"
MAX_SYNTHETIC_DEVICES = 256


class ImportError_(ValueError):
    """The input is not Kubernetes Node data (unparseable, or no Node in it)."""


def load_documents(text: str) -> list[Any]:
    """Parse ``kubectl`` output as JSON, else as (possibly multi-document) YAML.

    Raises:
        ImportError_: neither JSON nor YAML.
    """
    try:
        return [json.loads(text)]
    except ValueError:
        pass
    try:
        return [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        raise ImportError_(f"not JSON or YAML: {exc}") from exc


def node_objects(documents: list[Any]) -> tuple[list[dict], list[str]]:
    """The Node objects in ``documents`` (a Node, a NodeList or a ``kind: List``) and notes on skipped items.

    Items of a list without ``kind`` (as in a raw ``/api/v1/nodes`` answer) are taken as Nodes.
    """
    nodes: list[dict] = []
    notes: list[str] = []
    for doc in documents:
        if not isinstance(doc, dict):
            notes.append(f"skipped a {type(doc).__name__} document (expected a Node, NodeList or List)")
            continue
        kind = doc.get("kind")
        if kind in ("NodeList", "List") or (kind is None and isinstance(doc.get("items"), list)):
            for index, item in enumerate(doc.get("items") or []):
                if isinstance(item, dict) and item.get("kind", "Node") == "Node":
                    nodes.append(item)
                else:
                    item_kind = item.get("kind") if isinstance(item, dict) else type(item).__name__
                    notes.append(f"items[{index}]: skipped an object of kind {item_kind}")
        elif kind == "Node":
            nodes.append(doc)
        else:
            notes.append(f"skipped an object of kind {kind!r}")
    return nodes, notes


@dataclass
class MappedNode:
    """One Kubernetes Node translated into Node fields, and what could not be translated."""

    uid: str
    name: str
    fields: dict
    unmapped: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    taints_added: dict = field(default_factory=dict)  # taint id -> timeAdded (aware datetime)

    @property
    def external_id(self) -> str:
        return EXTERNAL_PREFIX + self.uid


def _resources(section: dict, where: str, unmapped: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, quantity in (section or {}).items():
        if name not in BASE_RESOURCES and not name.startswith("hugepages-") and "/" not in name:
            unmapped.append(f"{where}.{name}={quantity}: not a resource nodepool places work on")
            continue
        try:
            out[name] = to_canonical(name, quantity)
        except QuantityError as exc:
            unmapped.append(f"{where}.{name}={quantity!r}: {exc}")
    return out


def _accelerators(resources: dict[str, int], labels: dict, unmapped: list[str]) -> list[dict]:
    accelerators = []
    for name, count in sorted(resources.items()):
        if not name.endswith("/gpu") or count <= 0:
            continue
        vendor = name.split("/", 1)[0]
        model = labels.get(f"{vendor}/gpu.product", "")
        memory_mib = labels.get(f"{vendor}/gpu.memory", "")
        accelerator = {"type": name, "model": model, "memory": 0, "count": count}
        if memory_mib.isascii() and memory_mib.isdigit():
            accelerator["memory"] = int(memory_mib) * MIB
        if not model:
            unmapped.append(f"{name}: {count} without GPU feature discovery labels; model and memory unknown")
        label_count = labels.get(f"{vendor}/gpu.count")
        if label_count and label_count.isascii() and label_count.isdigit() and int(label_count) != count:
            unmapped.append(f"{vendor}/gpu.count label says {label_count} but capacity says {count}")
        accelerators.append(accelerator)
    return accelerators


def synthetic_devices(mapped: MappedNode) -> list[dict]:
    """The node's count-only device resources as wire devices (DEVICES-WIRE.md) with synthetic ids.

    ``nvidia.com/gpu: 8`` becomes ``k8s-<uid>/nvidia.com/gpu/0`` … ``/7`` (type
    ``nvidia.com/gpu``, index 0-7); ``nvidia.com/mig-3g.20gb: 2`` two ``nvidia.com/mig`` devices
    with that profile. Model and memory come from ``<vendor>/gpu.product`` and
    ``<vendor>/gpu.memory`` (MiB) when GPU feature discovery set them. At most 256 per node.
    """
    labels = mapped.fields["labels"]
    out: list[dict] = []
    for name, count in sorted(mapped.fields["declared"]["resources"].items()):
        matched = DEVICE_RESOURCE.fullmatch(name)
        if not matched or count <= 0:
            continue
        vendor = name.split("/", 1)[0]
        profile = matched.group("profile")
        device = {"type": "nvidia.com/mig" if profile else name}
        if profile:
            device["mig_profile"] = profile
        if name.endswith("/gpu") or profile:
            if labels.get(f"{vendor}/gpu.product"):
                device["model"] = labels[f"{vendor}/gpu.product"][:200]
            memory = labels.get(f"{vendor}/gpu.memory", "")
            if memory.isascii() and memory.isdigit() and not profile:
                device["memory_bytes"] = int(memory) * MIB
        for index in range(min(count, MAX_SYNTHETIC_DEVICES - len(out))):
            out.append({"id": f"{SYNTHETIC_PREFIX}{mapped.uid}/{name}/{index}", "index": index, **device})
    return out


def _import_devices(node: Node, mapped: MappedNode, actor: Actor, *, force: bool) -> int:
    """Store the node's synthetic devices (unverified); returns how many it has. Not when the
    node already has real devices (an agent reported them: they win over the dump)."""
    wire = synthetic_devices(mapped)
    live = Device.objects.filter(node=node, retired_at__isnull=True)
    if not wire or live.exclude(device_id__startswith=SYNTHETIC_PREFIX).exists():
        return 0
    parsed, refusals = parse_devices(wire)
    apply_report(node=node, devices=parsed, refusals=refusals, boot_id=None, actor=actor, force=force)
    rows = list(live.filter(device_id__startswith=SYNTHETIC_PREFIX))
    for row in rows:
        row.declared = {**row.declared, "source": "kubernetes", "synthetic": True}
    Device.objects.bulk_update(rows, ["declared"])
    return len(rows)


def _taints(spec: dict, unmapped: list[str]) -> tuple[list[dict], dict]:
    """The node's taints, and the ``timeAdded`` of those that carry one (by taint id)."""
    taints, added = [], {}
    for taint in spec.get("taints") or []:
        key, effect = taint.get("key"), taint.get("effect")
        if not key or effect not in TAINT_EFFECTS:
            unmapped.append(f"taint {taint!r}: no key or unknown effect")
            continue
        mapped = {"key": key, "value": taint.get("value", ""), "effect": effect}
        taints.append(mapped)
        when = _time(taint.get("timeAdded"))
        if taint.get("timeAdded") and when is None:
            unmapped.append(f"taint {key}:{effect}: timeAdded {taint['timeAdded']!r} is not an RFC 3339 time")
        elif when is not None:
            added[taint_times.taint_id(mapped)] = when
    return taints, added


def _time(value: Any):
    """An RFC 3339 time (``2024-05-01T10:00:00Z``) as an aware datetime, or None."""
    if not isinstance(value, str):
        return None
    try:
        parsed = parse_datetime(value)
    except ValueError:
        return None
    return parsed if parsed is not None and parsed.tzinfo is not None else None


def _runtime_name(version: str) -> str:
    """``containerd://1.6.21`` → ``containerd``; ``cri-o://1.20`` → ``cri-o``."""
    return version.split("://", 1)[0] if "://" in version else version


def map_node(obj: dict) -> MappedNode:
    """Translate one Kubernetes Node object. Pure: touches no database.

    Raises:
        ImportError_: the object has no ``metadata.uid`` or ``metadata.name``.
    """
    metadata, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    uid, name = metadata.get("uid"), metadata.get("name")
    if not uid or not name:
        raise ImportError_(f"node {name or '?'}: metadata.uid and metadata.name are required")
    unmapped: list[str] = []
    labels = {str(k): str(v) for k, v in (metadata.get("labels") or {}).items()}
    info = status.get("nodeInfo") or {}
    capacity = _resources(status.get("capacity") or {}, "capacity", unmapped)
    allocatable = _resources(status.get("allocatable") or {}, "allocatable", unmapped)
    runtime_version = info.get("containerRuntimeVersion", "")
    features = {
        "arch": info.get("architecture") or labels.get("kubernetes.io/arch", ""),
        "os": info.get("operatingSystem") or labels.get("kubernetes.io/os", ""),
        "kernel": info.get("kernelVersion", ""),
        "runtimes": [_runtime_name(runtime_version)] if runtime_version else [],
        "network_class": "",
        "services": [],
    }
    details = {
        "os_image": info.get("osImage", ""),
        "container_runtime_version": runtime_version,
        "kubelet_version": info.get("kubeletVersion", ""),
        "provider_id": spec.get("providerID", ""),
        "runtime_handlers": [h.get("name") for h in status.get("runtimeHandlers") or [] if h.get("name")],
    }
    addresses = status.get("addresses") or []
    hostname = next((a["address"] for a in addresses if a.get("type") == "Hostname"), "")
    hostname = hostname or labels.get("kubernetes.io/hostname") or name
    address_list: list[str] = []
    for address in addresses:
        if address.get("type") in ADDRESS_TYPES and address.get("address") not in address_list:
            address_list.append(address["address"])
        elif address.get("type") not in ADDRESS_TYPES + ("Hostname",):
            unmapped.append(f"address of type {address.get('type')!r} ignored")
    conditions = [
        {
            "type": c.get("type", ""),
            "status": c.get("status", "Unknown"),
            "reason": c.get("reason", ""),
            "message": c.get("message", ""),
            "last_transition_time": c.get("lastTransitionTime", ""),
        }
        for c in status.get("conditions") or []
    ]
    ready = next((c for c in conditions if c["type"] == "Ready"), None)
    ready_reason = "imported from Kubernetes"
    if ready:
        ready_reason += f"; Ready={ready['status']}" + (f" ({ready['reason']})" if ready["reason"] else "")
    if spec.get("unschedulable"):
        unmapped.append("spec.unschedulable: cordoned in Kubernetes; imported as pending (cordon after admission)")
    if metadata.get("finalizers"):
        unmapped.append(f"metadata.finalizers ignored: {', '.join(metadata['finalizers'])}")
    annotations = metadata.get("annotations") or {}
    if annotations:
        unmapped.append(f"{len(annotations)} annotations ignored")
    for section in IGNORED_SPEC:
        if spec.get(section):
            unmapped.append(f"spec.{section} ignored")
    for section in IGNORED_STATUS:
        if status.get(section):
            unmapped.append(f"status.{section} ignored")
    ids = [k for k in ("machineID", "systemUUID", "bootID") if info.get(k)]
    if ids:
        unmapped.append(f"nodeInfo.{'/'.join(ids)} ignored (identity comes from enrollment)")
    taints, taints_added = _taints(spec, unmapped)
    fields_ = {
        "hostname": hostname[:253],
        "display_name": name[:200],
        "addresses": address_list,
        "labels": labels,
        "taints": taints,
        "declared": {
            "resources": capacity,
            "allocatable": allocatable,
            "accelerators": _accelerators(capacity, labels, unmapped),
            "features": features,
        },
        "conditions": conditions,
        "ready": False,
        "ready_reason": ready_reason[:200],
    }
    return MappedNode(
        uid=str(uid), name=str(name), fields=fields_, unmapped=unmapped, details=details, taints_added=taints_added
    )


@dataclass
class ImportReport:
    """What an import did: names per outcome, and what could not be mapped per node."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unmapped: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    node_ids: dict[str, str] = field(default_factory=dict)


def import_nodes(*, text: str, pool: Pool, actor: Actor, dry_run: bool = False, source: str = "") -> ImportReport:
    """Create (or refresh) one pending node per Kubernetes Node in ``text``.

    Idempotent on ``metadata.uid``: a node imported before is updated in place when its mapped
    fields changed (a ``policy`` event lists them) and left alone otherwise; its lifecycle is
    never touched. A node imported into another pool is skipped (nodes do not change pool), and so
    is a node an agent took over (fleet.takeover: the agent's inventory wins over the dump's).
    Each node is its own transaction, so one bad object does not stop the rest.

    Raises:
        ImportError_: the text is not JSON/YAML or holds no Node.
    """
    nodes, notes = node_objects(load_documents(text))
    if not nodes:
        raise ImportError_("no Node objects found (expected kubectl get nodes -o json|yaml output)")
    report = ImportReport(notes=notes)
    for obj in nodes:
        try:
            mapped = map_node(obj)
        except ImportError_ as exc:
            report.skipped.append(str(exc))
            continue
        if mapped.unmapped:
            report.unmapped[mapped.name] = mapped.unmapped
        if dry_run:
            exists = Node.objects.filter(external_id=mapped.external_id).exists()
            (report.unchanged if exists else report.created).append(mapped.name)
            continue
        try:
            outcome, node = _upsert(mapped, pool=pool, actor=actor, source=source)
        except IntegrityError:
            # Another import created the same uid between our lookup and insert: theirs stands.
            outcome, node = _upsert(mapped, pool=pool, actor=actor, source=source)
        if outcome == "skipped":
            report.skipped.append(f"{mapped.name}: already imported into pool {node.pool.name}; not moved")
        elif outcome == "taken_over":
            report.skipped.append(f"{mapped.name}: an agent took this node over; its report wins, not updated")
        else:
            getattr(report, outcome).append(mapped.name)
        report.node_ids[mapped.name] = str(node.pk)
    return report


def _upsert(mapped: MappedNode, *, pool: Pool, actor: Actor, source: str) -> tuple[str, Node]:
    with transaction.atomic():
        node = Node.objects.select_for_update(no_key=True).filter(external_id=mapped.external_id).first()
        now = timezone.now()
        if node is None:
            added = taint_times.stamp({}, mapped.fields["taints"], now, given=mapped.taints_added)
            node = Node.objects.create(
                pool=pool, external_id=mapped.external_id, taints_added_at=added, **mapped.fields
            )
            devices = _import_devices(node, mapped, actor, force=True)
            record_event(
                node,
                event_types.ENROLLED,
                actor,
                to_state=Lifecycle.PENDING,
                reason=f"imported from Kubernetes node {mapped.name}",
                data={
                    "source": "kubernetes",
                    "uid": mapped.uid,
                    "file": source,
                    "node_info": mapped.details,
                    "unmapped": mapped.unmapped,
                    "synthetic_devices": devices,
                },
            )
            return "created", node
        if node.pool_id != pool.pk:
            return "skipped", node
        if node.enrolled_agent_version:
            # An agent took the node over (fleet.takeover): its own word about the machine (and
            # its real devices) wins over the dump's, so a re-import leaves it alone.
            return "taken_over", node
        _import_devices(node, mapped, actor, force=False)
        changed = [name for name, value in mapped.fields.items() if getattr(node, name) != value]
        added = taint_times.stamp(node.taints_added_at, mapped.fields["taints"], now, given=mapped.taints_added)
        if added != node.taints_added_at:
            changed.append("taints_added_at")
        if not changed:
            return "unchanged", node
        for name in changed:
            setattr(node, name, added if name == "taints_added_at" else mapped.fields[name])
        node.version += 1
        node.save(update_fields=[*changed, "version", "updated_at"])
        record_event(
            node,
            event_types.POLICY,
            actor,
            reason=f"re-imported from Kubernetes node {mapped.name}",
            data={
                "source": "kubernetes",
                "uid": mapped.uid,
                "file": source,
                "changed": changed,
                "node_info": mapped.details,
            },
        )
        return "updated", node
