"""NVIDIA GPUs: inventory from ``nvidia-smi``, per-device health, XID events from NVML or the kernel.

Sources, each optional except the first (a host without ``nvidia-smi`` on PATH has no GPUs):

* ``nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id,serial,driver_version
  --format=csv,noheader,nounits``: each GPU's identity. Only long-stable fields are asked for,
  because nvidia-smi refuses the whole query when one field is unknown to the driver.
* ``nvidia-smi -q -x`` (the XML log, ``nvsmi_device_v12.dtd``): CUDA version, MIG instances
  (``<mig_devices>``), memory, and health: volatile uncorrectable ECC (``<ecc_errors>``), pending
  page retirement (``<retired_pages>``), row-remap failure (``<remapped_rows>``), thermal and power
  throttling (``<clocks_event_reasons>``, ``<clocks_throttle_reasons>`` before driver 535).
* ``nvidia-smi -L``: each MIG instance's UUID and profile (the XML carries neither on most drivers).
* ``nvidia-smi topo -m``: the interconnect group (GPUs joined by NVLink, ``NV#``, form one group
  ``nvlink-N``; without NVLink, GPUs behind one PCIe switch, ``PIX``/``PXB``, form ``pcie-N``)
  and the NUMA node (``NUMA Affinity``; else ``/sys/bus/pci/devices/<bus id>/numa_node``).

XID events are not in any ``nvidia-smi`` query. Two sources, behind :class:`agent.xid.XidSource`:

* :class:`agent.xid.NvmlXidListener` (default where ``pynvml`` from ``nvidia-ml-py`` loads and NVML
  initialises): a thread waiting on ``nvmlEventSetWait_v2`` for ``nvmlEventTypeXidCriticalError``
  on every GPU. Privilege: read/write access to ``/dev/nvidiactl`` and ``/dev/nvidia<N>`` -- what
  ``nvidia-smi`` needs; no root on a default driver install (device nodes mode 0666).
* :class:`agent.xid.KernelLogXids`: the driver's ``NVRM: Xid (PCI:0000:17:00): 79, pid=..., <text>`` lines
  read from ``/dev/kmsg``. Privilege: ``CAP_SYSLOG`` (root) where ``kernel.dmesg_restrict=1``,
  the default on most distributions. Xid 154's text carries the driver's recovery action, which
  NVML's event does not, so where both are readable operators may prefer this one
  (``--xid-source kmsg``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from .devices import pci_key
from .xid import XidSource

log = logging.getLogger(__name__)

QUERY_FIELDS = ("index", "uuid", "name", "memory.total", "pci.bus_id", "serial", "driver_version")
MIB = 2**20
NA = {"", "n/a", "[n/a]", "[not supported]", "not supported", "none", "[unknown error]"}
SYSFS_PCI = Path("/sys/bus/pci/devices")


def _value(text: str | None) -> str | None:
    """The text of a field, None for nvidia-smi's ways of saying "no value"."""
    if text is None:
        return None
    text = text.strip()
    return None if text.lower() in NA else text


def _int(text: str | None) -> int | None:
    text = _value(text)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def _mib_bytes(text: str | None) -> int | None:
    """``"81559 MiB"`` or ``"81559"`` (nounits) -> bytes."""
    mib = _int(text)
    return mib * MIB if mib is not None else None


# -- parsers (pure) ---------------------------------------------------------------------------
def parse_query(stdout: str) -> list[dict]:
    """The rows of ``--query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits``, one dict per GPU
    (keys as in ``QUERY_FIELDS``). A row with the wrong number of cells or no UUID is skipped."""
    rows = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(QUERY_FIELDS):
            log.warning("nvidia-smi row not understood: %r", line[:200])
            continue
        row = dict(zip(QUERY_FIELDS, cells, strict=True))
        if _value(row["uuid"]) is None or _int(row["index"]) is None:
            continue
        rows.append(row)
    return rows


def _flag(element: ET.Element | None, *paths: str) -> bool | None:
    """True when any of ``paths`` under ``element`` reads Active/Yes; None if none is present."""
    if element is None:
        return None
    seen = False
    for path in paths:
        node = element.find(path)
        value = _value(node.text if node is not None else None)
        if value is None:
            continue
        seen = True
        if value.lower() in ("active", "yes", "true"):
            return True
    return False if seen else None


def _throttle(gpu: ET.Element, reasons: tuple[str, ...]) -> bool | None:
    paths = []
    for block, prefix in (
        ("clocks_event_reasons", "clocks_event_reason_"),
        ("clocks_throttle_reasons", "clocks_throttle_reason_"),
    ):
        paths += [f"{block}/{prefix}{reason}" for reason in reasons]
    return _flag(gpu, *paths)


_UNCORRECTABLE_TAGS = (
    "dram_uncorrectable",
    "sram_uncorrectable",
    "sram_uncorrectable_parity",
    "sram_uncorrectable_secded",
)


def _ecc_uncorrectable(gpu: ET.Element) -> int | None:
    """Volatile uncorrectable ECC errors: ``dram_uncorrectable`` + SRAM counters (Ampere+
    drivers), or ``double_bit/total`` (older layout)."""
    volatile = gpu.find("ecc_errors/volatile")
    if volatile is None:
        return None
    counts = [_int(node.text) for node in volatile if node.tag in _UNCORRECTABLE_TAGS]
    legacy = volatile.find("double_bit/total")
    if legacy is not None:
        counts.append(_int(legacy.text))
    counts = [c for c in counts if c is not None]
    return sum(counts) if counts else None


def parse_xml(text: str) -> dict:
    """``nvidia-smi -q -x`` -> ``{"driver_version", "cuda_version", "gpus": {pci key: {...}}}``.

    Per GPU: ``uuid``, ``minor_number``, ``memory_bytes``, ``mig_enabled``, ``mig_devices``
    (``[{"index", "gpu_instance_id", "compute_instance_id", "memory_bytes", "uuid"}]``), and
    ``health`` (``ecc_uncorrectable``, ``retired_pages_pending``, ``remapped_rows_failure``,
    ``thermal_throttle``, ``power_throttle``; None where the GPU does not say).

    Raises:
        ValueError: the text is not an ``nvidia_smi_log`` document.
    """
    try:
        # The local driver tool's output, not network input: no entity expansion to fear.
        root = ET.fromstring(text)  # noqa: S314
    except ET.ParseError as exc:
        raise ValueError(f"nvidia-smi -q -x: not XML ({exc})") from exc
    if root.tag != "nvidia_smi_log":
        raise ValueError(f"nvidia-smi -q -x: root is <{root.tag}>")
    out = {
        "driver_version": _value(root.findtext("driver_version")),
        "cuda_version": _value(root.findtext("cuda_version")),
        "gpus": {},
    }
    for gpu in root.findall("gpu"):
        bus_id = gpu.get("id") or gpu.findtext("pci/pci_bus_id") or ""
        mig_devices = []
        for mig in gpu.findall("mig_devices/mig_device"):
            mig_devices.append(
                {
                    "index": _int(mig.findtext("index")),
                    "gpu_instance_id": _int(mig.findtext("gpu_instance_id")),
                    "compute_instance_id": _int(mig.findtext("compute_instance_id")),
                    "memory_bytes": _mib_bytes(mig.findtext("fb_memory_usage/total")),
                    "uuid": _value(mig.findtext("uuid")),
                }
            )
        remap_failure = _flag(gpu, "remapped_rows/remapped_row_failure", "remapped_rows/failure")
        out["gpus"][pci_key(bus_id)] = {
            "uuid": _value(gpu.findtext("uuid")),
            "minor_number": _int(gpu.findtext("minor_number")),
            "memory_bytes": _mib_bytes(gpu.findtext("fb_memory_usage/total")),
            "mig_enabled": (_value(gpu.findtext("mig_mode/current_mig")) or "").lower() == "enabled",
            "mig_devices": mig_devices,
            "numa_node": _int(gpu.findtext("numa_node")),
            "health": {
                "ecc_uncorrectable": _ecc_uncorrectable(gpu),
                "retired_pages_pending": _flag(gpu, "retired_pages/pending_retirement"),
                "remapped_rows_failure": remap_failure,
                "thermal_throttle": _throttle(gpu, ("hw_thermal_slowdown", "sw_thermal_slowdown")),
                "power_throttle": _throttle(gpu, ("sw_power_cap", "hw_power_brake_slowdown")),
            },
        }
    return out


_LIST_GPU = re.compile(r"^GPU\s+(\d+):.*\(UUID:\s*(GPU-[^)\s]+)\)")
_LIST_MIG = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+(\d+):\s*\(UUID:\s*(MIG-[^)\s]+)\)")


def parse_list(stdout: str) -> dict[int, list[dict]]:
    """``nvidia-smi -L`` -> ``{gpu index: [{"profile", "index", "uuid"}]}`` for MIG instances."""
    out: dict[int, list[dict]] = {}
    current: int | None = None
    for line in stdout.splitlines():
        gpu = _LIST_GPU.match(line)
        if gpu:
            current = int(gpu.group(1))
            out.setdefault(current, [])
            continue
        mig = _LIST_MIG.match(line)
        if mig and current is not None:
            out[current].append({"profile": mig.group(1), "index": int(mig.group(2)), "uuid": mig.group(3)})
    return out


_DEVICE_COLUMN = re.compile(r"(GPU|NIC|mlx|MLX)\w*?\d+")


def _groups(indices: list[int], linked) -> list[list[int]]:
    """Connected components (size > 1) of ``indices`` under ``linked(i, j)``, by lowest member."""
    parent = {i: i for i in indices}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in indices:
        for j in indices:
            if i < j and linked(i, j):
                parent[find(i)] = find(j)
    members: dict[int, list[int]] = {}
    for i in indices:
        members.setdefault(find(i), []).append(i)
    return sorted((sorted(m) for m in members.values() if len(m) > 1), key=lambda m: m[0])


def parse_topology(stdout: str) -> dict[int, dict]:
    """``nvidia-smi topo -m`` -> ``{gpu index: {"interconnect_group", "numa_node"}}``.

    GPUs linked by NVLink (``NV#``), transitively, form ``nvlink-N``; GPUs with no NVLink peer
    that share a PCIe switch (``PIX``/``PXB``) form ``pcie-N``; N counts groups of a kind by their
    lowest GPU index. A GPU in neither gets None. ``numa_node`` is the ``NUMA Affinity`` column
    (the second after the link matrix, after ``CPU Affinity``) when it is one number.
    """
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in stdout.splitlines() if line.strip()]
    if not lines:
        return {}
    columns = [h for h in lines[0].split() if _DEVICE_COLUMN.fullmatch(h)]
    numa_column = 1 if "NUMA Affinity" in lines[0] else None
    links: dict[int, dict[int, str]] = {}
    out: dict[int, dict] = {}
    for line in lines[1:]:
        cells = line.split()
        name = re.fullmatch(r"GPU(\d+)", cells[0])
        if not name:
            continue  # NIC rows, the legend
        index = int(name.group(1))
        matrix = cells[1 : 1 + len(columns)]
        links[index] = {int(c[3:]): v for c, v in zip(columns, matrix, strict=False) if re.fullmatch(r"GPU\d+", c)}
        trailing = cells[1 + len(columns) :]
        numa = None
        if numa_column is not None and len(trailing) > numa_column:
            with contextlib.suppress(ValueError):
                numa = int(trailing[numa_column])
        out[index] = {"interconnect_group": None, "numa_node": numa}
    indices = sorted(links)
    nvlinked = _groups(indices, lambda i, j: links[i].get(j, "").startswith("NV"))
    for n, members in enumerate(nvlinked):
        for i in members:
            out[i]["interconnect_group"] = f"nvlink-{n}"
    rest = [i for i in indices if out[i]["interconnect_group"] is None]
    for n, members in enumerate(_groups(rest, lambda i, j: links[i].get(j) in ("PIX", "PXB"))):
        for i in members:
            out[i]["interconnect_group"] = f"pcie-{n}"
    return out


def sysfs_numa_node(bus_id: str, root: Path = SYSFS_PCI) -> int | None:
    """The NUMA node Linux gives the PCI device (``-1`` = none -> None)."""
    key = pci_key(bus_id)
    function = bus_id.rsplit(".", 1)[-1] if "." in bus_id else "0"
    try:
        node = int((root / f"{key}.{function}".lower() / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


# -- the provider -----------------------------------------------------------------------------
class NvidiaProvider:
    """NVIDIA GPUs and MIG instances as DEVICES-WIRE devices (see the module docstring).

    Args:
        run, which: ``subprocess.run`` and ``shutil.which`` (tests pass fakes, or put a fake
            ``nvidia-smi`` on PATH).
        xid_source: an :class:`XidSource`, or a callable returning one, opened on first use
            (default: :func:`agent.xid.open_xid_source` ``("auto")`` once a GPU is found).
        sysfs: where PCI devices' ``numa_node`` files are.
    """

    name = "nvidia"

    def __init__(self, *, run=subprocess.run, which=shutil.which, xid_source=None, sysfs: Path = SYSFS_PCI):
        self.run = run
        self.which = which
        self._xid_source = xid_source
        self.sysfs = sysfs
        self.found = False  # a GPU was seen: only then is an XID source worth opening

    def _smi(self, *args: str, required: bool = False) -> str | None:
        try:
            proc = self.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("nvidia-smi %s failed: %s", " ".join(args), exc)
            return None
        if proc.returncode != 0:
            said = (proc.stderr or proc.stdout or "").strip()[:200]
            say = log.warning if required else log.info
            say("nvidia-smi %s exited %s: %s", " ".join(args), proc.returncode, said)
            return None
        return proc.stdout

    def inventory(self) -> list[dict]:
        """Every GPU (``nvidia.com/gpu``) and MIG instance (``nvidia.com/mig``), GPUs by index."""
        if not self.which("nvidia-smi"):
            return []
        stdout = self._smi(f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits", required=True)
        rows = parse_query(stdout or "")
        if not rows:
            return []
        self.found = True
        details: dict = {"gpus": {}}
        xml = self._smi("-q", "-x")
        if xml:
            try:
                details = parse_xml(xml)
            except ValueError as exc:
                log.warning("%s", exc)
        migs = parse_list(self._smi("-L") or "") if any(g.get("mig_enabled") for g in details["gpus"].values()) else {}
        topology = parse_topology(self._smi("topo", "-m") or "")
        devices = []
        for row in sorted(rows, key=lambda r: _int(r["index"])):
            index = _int(row["index"])
            bus_id = _value(row["pci.bus_id"])
            extra = details["gpus"].get(pci_key(bus_id), {})
            where = topology.get(index, {})
            numa = where.get("numa_node")
            if numa is None:
                numa = extra.get("numa_node")
            if numa is None and bus_id:
                numa = sysfs_numa_node(bus_id, self.sysfs)
            gpu = {
                "id": _value(row["uuid"]),
                "type": "nvidia.com/gpu",
                "index": index,
                "model": _value(row["name"]),
                "memory_bytes": _mib_bytes(row["memory.total"]) or extra.get("memory_bytes"),
                "mig_profile": None,
                "parent": None,
                "pci_bus_id": bus_id,
                "numa_node": numa,
                "interconnect_group": where.get("interconnect_group"),
                "serial": _value(row["serial"]),
                "driver_version": _value(row["driver_version"]) or details.get("driver_version"),
                "cuda_version": details.get("cuda_version"),
                "health": dict(
                    extra.get("health")
                    or {
                        "ecc_uncorrectable": None,
                        "retired_pages_pending": None,
                        "remapped_rows_failure": None,
                        "thermal_throttle": None,
                        "power_throttle": None,
                    }
                ),
            }
            devices.append(gpu)
            listed = {m["index"]: m for m in migs.get(index, [])}
            for mig in extra.get("mig_devices", []):
                named = listed.get(mig["index"], {})
                uuid = mig.get("uuid") or named.get("uuid")
                if not uuid:
                    log.warning("GPU %s: MIG device %s has no UUID; not reported", index, mig["index"])
                    continue
                devices.append(
                    {
                        **{k: gpu[k] for k in ("model", "pci_bus_id", "numa_node", "interconnect_group")},
                        **{k: gpu[k] for k in ("driver_version", "cuda_version")},
                        "id": uuid,
                        "type": "nvidia.com/mig",
                        "index": mig["index"],
                        "memory_bytes": mig.get("memory_bytes"),
                        "mig_profile": named.get("profile"),
                        "parent": gpu["id"],
                        "serial": None,
                        "health": dict(gpu["health"]),
                    }
                )
        return devices

    def xid_events(self) -> list[dict]:
        if self._xid_source is None or not self.found:
            return []
        if callable(self._xid_source) and not isinstance(self._xid_source, XidSource):
            self._xid_source = self._xid_source()
        return self._xid_source.drain()

    def close(self) -> None:
        if isinstance(self._xid_source, XidSource):
            self._xid_source.close()
