"""A fake ``nvidia-smi`` for tests on machines without a GPU (there is none on ours or CI's).

:func:`write_fake_nvidia_smi` writes an executable ``nvidia-smi`` into a directory; put that
directory first on ``PATH`` (:meth:`FakeNvidiaSmi.path`) and the agent finds N GPUs. The script
answers what the agent runs, in the shapes NVIDIA documents and published outputs show:

* ``--query-gpu=<fields> --format=csv,noheader[,nounits]`` (an unknown field fails the whole
  query with exit 2, as the real tool does);
* ``-q -x``: the ``nvidia_smi_log`` XML (``nvsmi_device_v12.dtd`` layout: ``<gpu id="...">``
  with ``<uuid>``, ``<minor_number>``, ``<mig_mode>``, ``<mig_devices>``, ``<fb_memory_usage>``,
  ``<ecc_errors><volatile><dram_uncorrectable>``, ``<retired_pages>``, ``<remapped_rows>``,
  ``<clocks_event_reasons>``; ``legacy_xml=True`` gives the pre-535 names
  ``<clocks_throttle_reasons>`` and ``<double_bit><total>``);
* ``-L`` (with MIG instance lines) and ``topo -m`` (NVLink ``NV18`` inside a group, ``SYS``
  across; ``NUMA Affinity`` column).

The GPUs live in ``nvidia-smi.json`` beside the script: :meth:`FakeNvidiaSmi.update_gpu` changes
one (an ECC error, a throttle) and the next call of the fake shows it.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

H100 = "NVIDIA H100 80GB HBM3"

_SCRIPT = r'''#!{python}
"""Fake nvidia-smi written by tests/gpu_support.py: answers from nvidia-smi.json beside it."""
import json, sys
from pathlib import Path

spec = json.loads((Path(__file__).parent / "nvidia-smi.json").read_text())
gpus = spec["gpus"]
args = sys.argv[1:]
(Path(__file__).parent / "calls.log").open("a").write(" ".join(args) + "\n")
if spec.get("fail"):
    sys.stderr.write("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
    sys.exit(9)


def flag(value):
    return "Active" if value else "Not Active"


def yes(value):
    return "Yes" if value else "No"


def field(gpu, name, units):
    mib = " MiB" if units else ""
    values = {{
        "index": gpu["index"], "uuid": gpu["uuid"], "name": gpu["name"], "gpu_name": gpu["name"],
        "memory.total": f"{{gpu['memory_mib']}}{{mib}}", "pci.bus_id": gpu["pci_bus_id"],
        "serial": gpu.get("serial") or "[N/A]", "driver_version": spec["driver_version"],
    }}
    if name not in values:
        sys.stderr.write(f'Field "{{name}}" is not a valid field to query.\n')
        sys.exit(2)
    return str(values[name])


if args and args[0].startswith("--query-gpu="):
    fields = args[0].split("=", 1)[1].split(",")
    units = "nounits" not in " ".join(args)
    for gpu in gpus:
        print(", ".join(field(gpu, name, units) for name in fields))
elif args == ["-L"]:
    for gpu in gpus:
        print(f"GPU {{gpu['index']}}: {{gpu['name']}} (UUID: {{gpu['uuid']}})")
        for mig in gpu.get("mig", []):
            print(f"  MIG {{mig['profile']:<13}} Device {{mig['index']:>2}}: (UUID: {{mig['uuid']}})")
elif args == ["-q", "-x"]:
    legacy = spec.get("legacy_xml", False)
    out = ['<?xml version="1.0" ?>', '<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">', "<nvidia_smi_log>",
           "<timestamp>Wed Dec  2 10:00:00 2026</timestamp>",
           f"<driver_version>{{spec['driver_version']}}</driver_version>",
           f"<cuda_version>{{spec['cuda_version']}}</cuda_version>",
           f"<attached_gpus>{{len(gpus)}}</attached_gpus>"]
    for gpu in gpus:
        migs = gpu.get("mig", [])
        out += [f'<gpu id="{{gpu["pci_bus_id"]}}">', f"<product_name>{{gpu['name']}}</product_name>",
                "<product_brand>NVIDIA</product_brand>",
                f"<mig_mode><current_mig>{{'Enabled' if migs else 'Disabled'}}</current_mig>"
                f"<pending_mig>{{'Enabled' if migs else 'Disabled'}}</pending_mig></mig_mode>"]
        if migs:
            out.append("<mig_devices>")
            for mig in migs:
                out += ["<mig_device>", f"<index>{{mig['index']}}</index>",
                        f"<gpu_instance_id>{{mig['gpu_instance_id']}}</gpu_instance_id>",
                        f"<compute_instance_id>{{mig['compute_instance_id']}}</compute_instance_id>",
                        f"<fb_memory_usage><total>{{mig['memory_mib']}} MiB</total><reserved>0 MiB</reserved>"
                        f"<used>0 MiB</used><free>{{mig['memory_mib']}} MiB</free></fb_memory_usage>"]
                if spec.get("mig_uuid_in_xml"):
                    out.append(f"<uuid>{{mig['uuid']}}</uuid>")
                out.append("</mig_device>")
            out.append("</mig_devices>")
        else:
            out.append("<mig_devices>None</mig_devices>")
        out += [f"<serial>{{gpu.get('serial') or 'N/A'}}</serial>", f"<uuid>{{gpu['uuid']}}</uuid>",
                f"<minor_number>{{gpu['index']}}</minor_number>",
                f"<pci><pci_bus_id>{{gpu['pci_bus_id']}}</pci_bus_id></pci>"]
        block, prefix = ("clocks_throttle_reasons", "clocks_throttle_reason_") if legacy else (
            "clocks_event_reasons", "clocks_event_reason_")
        out += [f"<{{block}}>", f"<{{prefix}}gpu_idle>Not Active</{{prefix}}gpu_idle>",
                f"<{{prefix}}sw_power_cap>{{flag(gpu['power_throttle'])}}</{{prefix}}sw_power_cap>",
                f"<{{prefix}}hw_slowdown>Not Active</{{prefix}}hw_slowdown>",
                f"<{{prefix}}hw_thermal_slowdown>{{flag(gpu['thermal_throttle'])}}</{{prefix}}hw_thermal_slowdown>",
                f"<{{prefix}}hw_power_brake_slowdown>Not Active</{{prefix}}hw_power_brake_slowdown>",
                f"<{{prefix}}sw_thermal_slowdown>Not Active</{{prefix}}sw_thermal_slowdown>", f"</{{block}}>",
                f"<fb_memory_usage><total>{{gpu['memory_mib']}} MiB</total><reserved>0 MiB</reserved>"
                f"<used>0 MiB</used><free>{{gpu['memory_mib']}} MiB</free></fb_memory_usage>",
                "<ecc_mode><current_ecc>Enabled</current_ecc><pending_ecc>Enabled</pending_ecc></ecc_mode>",
                "<ecc_errors><volatile>"]
        if legacy:
            out.append(f"<double_bit><device_memory>{{gpu['ecc_uncorrectable']}}</device_memory>"
                       f"<total>{{gpu['ecc_uncorrectable']}}</total></double_bit>")
        else:
            out += ["<sram_correctable>0</sram_correctable>",
                    "<sram_uncorrectable_parity>0</sram_uncorrectable_parity>",
                    "<sram_uncorrectable_secded>0</sram_uncorrectable_secded>",
                    "<dram_correctable>0</dram_correctable>",
                    f"<dram_uncorrectable>{{gpu['ecc_uncorrectable']}}</dram_uncorrectable>"]
        out += ["</volatile></ecc_errors>",
                "<retired_pages><multiple_single_bit_retirement><retired_count>N/A</retired_count>"
                "</multiple_single_bit_retirement><double_bit_retirement><retired_count>N/A</retired_count>"
                "</double_bit_retirement><pending_blacklist>N/A</pending_blacklist>"
                f"<pending_retirement>{{yes(gpu['retired_pages_pending'])}}</pending_retirement></retired_pages>",
                "<remapped_rows><remapped_row_corr>0</remapped_row_corr><remapped_row_unc>0</remapped_row_unc>"
                "<remapped_row_pending>No</remapped_row_pending>"
                f"<remapped_row_failure>{{yes(gpu['remapped_rows_failure'])}}</remapped_row_failure></remapped_rows>",
                "</gpu>"]
    out.append("</nvidia_smi_log>")
    print("\n".join(out))
elif args == ["topo", "-m"]:
    names = [f"GPU{{g['index']}}" for g in gpus]
    print("\t" + "\t".join(names) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID")
    for gpu in gpus:
        cells = []
        for other in gpus:
            if other is gpu:
                cells.append(" X ")
            elif gpu.get("nvlink_group") is not None and gpu.get("nvlink_group") == other.get("nvlink_group"):
                cells.append("NV18")
            else:
                cells.append("SYS")
        numa = gpu.get("numa_node")
        print(f"GPU{{gpu['index']}}\t" + "\t".join(cells) + f"\t0-47\t{{'N/A' if numa is None else numa}}\t\tN/A")
    print("\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect\n"
          "  NV#  = Connection traversing a bonded set of # NVLinks")
else:
    sys.stderr.write("fake nvidia-smi: unsupported arguments " + " ".join(args) + "\n")
    sys.exit(2)
'''


def gpu_uuid(seed: str, index: int) -> str:
    """A stable, well-formed GPU UUID (``GPU-8-4-4-4-12`` hex) for ``seed`` and ``index``."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'nodepool-test/{seed}/{index}')}"


def fake_gpus(
    count: int = 8,
    *,
    model: str = H100,
    memory_mib: int = 81559,
    nvlink_groups: int = 1,
    seed: str = "node",
    mig: dict[int, list[str]] | None = None,
) -> list[dict]:
    """``count`` GPUs as the fake describes them.

    Args:
        nvlink_groups: GPUs are split into this many NVLink islands of equal size (0: no NVLink);
            the islands are also the NUMA nodes.
        seed: varies the UUIDs and serials, so two fake hosts do not share devices.
        mig: ``{gpu index: ["3g.40gb", ...]}`` MIG instances to create on those GPUs.
    """
    per_group = max(1, -(-count // nvlink_groups)) if nvlink_groups else count
    gpus = []
    for index in range(count):
        group = index // per_group if nvlink_groups else None
        bus = 0x17 + index * 0x10
        gpu = {
            "index": index,
            "uuid": gpu_uuid(seed, index),
            "name": model,
            "memory_mib": memory_mib,
            "pci_bus_id": f"00000000:{bus:02X}:00.0",
            "serial": f"{uuid.uuid5(uuid.NAMESPACE_URL, f'nodepool-test/{seed}/{index}/serial').int % 10**13:013d}",
            "numa_node": group if group is not None else 0,
            "nvlink_group": group,
            "ecc_uncorrectable": 0,
            "retired_pages_pending": False,
            "remapped_rows_failure": False,
            "thermal_throttle": False,
            "power_throttle": False,
        }
        profiles = (mig or {}).get(index, [])
        gpu["mig"] = [
            {
                "index": n,
                "profile": profile,
                "uuid": f"MIG-{uuid.uuid5(uuid.NAMESPACE_URL, f'nodepool-test/{seed}/{index}/mig/{n}')}",
                "gpu_instance_id": n + 1,
                "compute_instance_id": 0,
                "memory_mib": int(profile.split(".")[1].removesuffix("gb")) * 1024 - 512 if "." in profile else 0,
            }
            for n, profile in enumerate(profiles)
        ]
        gpus.append(gpu)
    return gpus


@dataclass
class FakeNvidiaSmi:
    """A fake ``nvidia-smi`` on disk: ``directory`` holds the script and its ``nvidia-smi.json``."""

    directory: Path
    spec: dict = field(default_factory=dict)

    @property
    def gpus(self) -> list[dict]:
        return self.spec["gpus"]

    @property
    def uuids(self) -> list[str]:
        return [gpu["uuid"] for gpu in self.gpus]

    def path(self, rest: str | None = None) -> str:
        """A ``PATH`` value with the fake first (``rest`` defaults to the current PATH)."""
        return f"{self.directory}{os.pathsep}{os.environ.get('PATH', '') if rest is None else rest}"

    def save(self) -> None:
        (self.directory / "nvidia-smi.json").write_text(json.dumps(self.spec))

    def update_gpu(self, index: int, **changes) -> None:
        """Change one GPU (``ecc_uncorrectable=2``, ``thermal_throttle=True`` ...) for the next call."""
        self.gpus[index].update(changes)
        self.save()

    def calls(self) -> list[str]:
        """The argument lines the fake was called with, oldest first."""
        log = self.directory / "calls.log"
        return log.read_text().splitlines() if log.exists() else []


def write_fake_nvidia_smi(
    directory: str | os.PathLike,
    gpus: int | list[dict] = 8,
    *,
    driver_version: str = "550.54.15",
    cuda_version: str = "12.4",
    legacy_xml: bool = False,
    mig_uuid_in_xml: bool = False,
    **gpu_options,
) -> FakeNvidiaSmi:
    """Write an executable fake ``nvidia-smi`` showing ``gpus`` (a count for :func:`fake_gpus`,
    with ``gpu_options``, or the GPU dicts) into ``directory``; returns it (see the module doc)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    script.write_text(_SCRIPT.format(python=sys.executable))
    script.chmod(0o755)
    fake = FakeNvidiaSmi(
        directory,
        {
            "driver_version": driver_version,
            "cuda_version": cuda_version,
            "legacy_xml": legacy_xml,
            "mig_uuid_in_xml": mig_uuid_in_xml,
            "gpus": fake_gpus(gpus, **gpu_options) if isinstance(gpus, int) else gpus,
        },
    )
    fake.save()
    return fake
