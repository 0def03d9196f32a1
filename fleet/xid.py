"""The XID catalogue: what an NVIDIA Xid means for the device that reported it.

Pure data and functions, no models: the status-report path (devsrv) calls :func:`classify_xid`
for each ``health.xid_events[]`` entry of a device and turns the resolution into a device taint.

Source: NVIDIA, "Xid Errors" -- "Analyzing Xid Errors with the Xid Catalog" (Ampere and newer,
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), table 1 "Xids", column
"Resolution Bucket (Immediate Action)", with the "Resolution Bucket (Investigatory Action)" and
"Trigger Conditions" columns where the immediate bucket alone does not say whose fault it is.
The catalogue is keyed by driver release; this table follows the R565-R575 era rows (codes 1-172).

How a bucket becomes one of our four resolutions (:class:`Resolution`), first match wins:

- ``fatal`` (device taint ``NoExecute``: the GPU cannot keep running what is on it):
  ``RESTART_BM`` (79, fell off the bus), ``WORKFLOW_XID_48`` (48, double-bit ECC: uncorrectable,
  reported to the running work), ``WORKFLOW_NVLINK_ERR`` (74: the link is down, peer traffic is
  broken), 95 (``RESET_GPU``, but uncontained: "these errors affect multiple applications, and
  the affected GPU must be reset before applications can restart"), and Xid 154 whose message
  says "Node Reboot Required".
- ``application`` (no device taint: the workload's fault): ``RESTART_APP`` whose investigatory
  bucket points at the application (``CHECK_APP/CUDA``, ``WORKFLOW_XID_13``, ``WORKFLOW_XID_31``:
  11, 13, 25, 31, 32, 69, 80), ``WORKFLOW_XID_45`` (45: teardown after the application aborted),
  and 43 (``IGNORE``, but the trigger text says "a user application hits a software induced
  fault and must terminate. The GPU remains in a healthy state").
- ``info`` (no device taint; recorded -- a rising rate of 63 or 92 is a trend to watch, not an
  eviction): the other ``RESTART_APP`` rows (94 contained: "All other applications running at
  the time of the Xid are unaffected"; copy-engine and decoder exceptions), ``IGNORE`` (63, 64's
  harmless sibling, 92, 93 ...), and Xid 154 "None".
- ``reset_gpu`` (device taint ``NoSchedule``: no new work until a reset, a reboot or an operator
  clears it): ``RESET_GPU`` (46, 62, 64, 119, 120, 140 ...), ``RESTART_VM``, ``UPDATE_SWFW``,
  ``CHECK_MECHANICALS``, ``CHECK_UVM``, ``CONTACT_SUPPORT``, ``WORKFLOW_NVLINK5_ERR`` (144-150:
  the catalogue's answer depends on register decoding the agent does not do), Xid 154's drain
  and reset labels or no label, rows with no bucket yet (162-172), and every unknown XID (the
  safe default).

Codes the catalogue marks "Unused" for every product carry ``CONTACT_SUPPORT`` there, hence
``reset_gpu`` here: one appearing means something unexpected, so the GPU takes no new work.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class Resolution(StrEnum):
    """What an XID means for the device (see the module docstring for the rule)."""

    APPLICATION = "application"  # the workload's fault: nothing happens to the device
    INFO = "info"  # contained or warning level: recorded, evicts nothing
    RESET_GPU = "reset_gpu"  # needs a GPU reset, a reboot or support: device taint NoSchedule
    FATAL = "fatal"  # uncontained / fell off the bus: device taint NoExecute


TAINT_EFFECT: dict[Resolution, str | None] = {
    Resolution.APPLICATION: None,
    Resolution.INFO: None,
    Resolution.RESET_GPU: "NoSchedule",
    Resolution.FATAL: "NoExecute",
}


@dataclass(frozen=True)
class XidClass:
    """One XID's classification.

    Attributes:
        xid: the Xid number as the driver logs it (``NVRM: Xid (PCI:...): 79, ...``).
        mnemonic: NVIDIA's mnemonic (``ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS``), or
            ``"UNKNOWN"`` for a code not in the catalogue.
        immediate_action: NVIDIA's "Resolution Bucket (Immediate Action)" (``RESTART_BM``),
            ``""`` where the catalogue gives none.
        resolution: ours, one of :class:`Resolution`.
        known: False for a code the catalogue does not list (resolution is then ``reset_gpu``).
    """

    xid: int
    mnemonic: str
    immediate_action: str
    resolution: Resolution
    known: bool = True

    @property
    def taint_effect(self) -> str | None:
        """``"NoExecute"``, ``"NoSchedule"`` or None (no device taint)."""
        return TAINT_EFFECT[self.resolution]

    @property
    def evicts(self) -> bool:
        """True when running work on the device must go (``NoExecute``)."""
        return self.resolution is Resolution.FATAL


# Investigatory buckets that point at the application rather than the GPU.
_APPLICATION_INVESTIGATION = {"CHECK_APP/CUDA", "WORKFLOW_XID_13", "WORKFLOW_XID_31"}

# Codes whose catalogue row leads to a resolution the bucket alone would not give (why, above).
_OVERRIDES: dict[int, Resolution] = {
    43: Resolution.APPLICATION,  # IGNORE, but the trigger text names a user-application fault
    95: Resolution.FATAL,  # RESET_GPU, uncontained: the running applications are affected
}

_UNUSED = "CONTACT_SUPPORT"

# xid -> (mnemonic, immediate action, investigatory action), as the catalogue lists them.
# Rows marked "Unused" for every product are generated below (_UNUSED_CODES).
_CATALOGUE: dict[int, tuple[str, str, str]] = {
    8: ("ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "RESTART_APP", "CONTACT_SUPPORT"),
    11: ("ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "RESTART_APP", "CHECK_APP/CUDA"),
    13: ("ROBUST_CHANNEL_GR_EXCEPTION", "RESTART_APP", "WORKFLOW_XID_13"),
    14: ("ROBUST_CHANNEL_FAKE_ERROR", "IGNORE", "CONTACT_SUPPORT"),
    25: ("ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY", "RESTART_APP", "CHECK_APP/CUDA"),
    31: ("ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "RESTART_APP", "WORKFLOW_XID_31"),
    32: ("ROBUST_CHANNEL_PBDMA_ERROR", "RESTART_APP", "CHECK_APP/CUDA"),
    37: ("ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD", "IGNORE", "CHECK_APP/CUDA"),
    38: ("ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", "IGNORE", "CONTACT_SUPPORT"),
    39: ("ROBUST_CHANNEL_CE0_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    40: ("ROBUST_CHANNEL_CE1_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    41: ("ROBUST_CHANNEL_CE2_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    43: ("ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "IGNORE", "CONTACT_SUPPORT"),
    44: ("ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "IGNORE", "CONTACT_SUPPORT"),
    45: ("ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "WORKFLOW_XID_45", "RESTART_FM"),
    46: ("ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "RESET_GPU", "CONTACT_SUPPORT"),
    48: ("ROBUST_CHANNEL_GPU_ECC_DBE", "WORKFLOW_XID_48", "WORKFLOW_XID_48"),
    54: ("SILENT_RUNNING_PWR_REDUCED_CLOCKING", "CHECK_MECHANICALS", "CONTACT_SUPPORT"),
    60: ("ROBUST_CHANNEL_SEC2_ERROR", "RESTART_APP", "INVESTIGATE_SW"),
    62: ("PMU_HALT_ERROR", "RESET_GPU", "CONTACT_SUPPORT"),
    63: ("INFOROM_DRAM_RETIREMENT_EVENT", "IGNORE", "IGNORE"),
    64: ("INFOROM_DRAM_RETIREMENT_FAILURE", "RESET_GPU", "CONTACT_SUPPORT"),
    66: ("ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION", "IGNORE", "INVESTIGATE_SW"),
    67: ("ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION", "IGNORE", "CONTACT_SUPPORT"),
    68: ("ROBUST_CHANNEL_NVDEC0_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    69: ("ROBUST_CHANNEL_GR_CLASS_ERROR", "RESTART_APP", "CHECK_APP/CUDA"),
    70: ("ROBUST_CHANNEL_CE3_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    71: ("ROBUST_CHANNEL_CE4_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    72: ("ROBUST_CHANNEL_CE5_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    74: ("NVLINK_ERROR", "WORKFLOW_NVLINK_ERR", "CONTACT_SUPPORT"),
    75: ("ROBUST_CHANNEL_CE6_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    76: ("ROBUST_CHANNEL_CE7_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    77: ("ROBUST_CHANNEL_CE8_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    78: ("VGPU_START_ERROR", "UPDATE_SWFW", "UPDATE_SWFW"),
    79: ("ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM", "CONTACT_SUPPORT"),
    80: ("PBDMA_PUSHBUFFER_CRC_MISMATCH", "RESTART_APP", "CHECK_APP/CUDA"),
    82: ("ROBUST_CHANNEL_NVJPG0_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    83: ("ROBUST_CHANNEL_NVDEC1_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    84: ("ROBUST_CHANNEL_NVDEC2_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    85: ("ROBUST_CHANNEL_CE9_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    86: ("ROBUST_CHANNEL_OFA0_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    88: ("ROBUST_CHANNEL_NVDEC3_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    89: ("ROBUST_CHANNEL_NVDEC4_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    92: ("EXCESSIVE_SBE_INTERRUPTS", "IGNORE", "CONTACT_SUPPORT"),
    93: ("INFOROM_ERASE_LIMIT_EXCEEDED", "IGNORE", "CONTACT_SUPPORT"),
    94: ("ROBUST_CHANNEL_CONTAINED_ERROR", "RESTART_APP", "IGNORE"),
    95: ("ROBUST_CHANNEL_UNCONTAINED_ERROR", "RESET_GPU", "IGNORE"),
    96: ("ROBUST_CHANNEL_NVDEC5_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    97: ("ROBUST_CHANNEL_NVDEC6_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    98: ("ROBUST_CHANNEL_NVDEC7_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    **{99 + n: (f"ROBUST_CHANNEL_NVJPG{1 + n}_ERROR", "RESTART_APP", "CONTACT_SUPPORT") for n in range(7)},
    106: ("SMBPBI_TEST_MESSAGE", "IGNORE", "IGNORE"),
    107: ("SMBPBI_TEST_MESSAGE_SILENT", "IGNORE", "IGNORE"),
    108: ("NVLINK_REMOTE_TRANSLATION_ERROR", "IGNORE", "XID_137_FLOW"),
    109: ("ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "RESET_GPU", "CONTACT_SUPPORT"),
    110: ("SEC_FAULT_ERROR", "RESET_GPU", "INVESTIGATE_SW"),
    119: ("GSP_RPC_TIMEOUT", "RESET_GPU", "INVESTIGATE_SW"),
    120: ("GSP_ERROR", "RESET_GPU", "INVESTIGATE_SW"),
    121: ("C2C_ERROR", "IGNORE", "CONTACT_SUPPORT"),
    **{126 + n: (f"ROBUST_CHANNEL_CE{10 + n}_ERROR", "RESTART_APP", "CONTACT_SUPPORT") for n in range(10)},
    136: ("ALI_TRAINING_FAIL", "RESET_GPU", "INVESTIGATE_LINK_SI"),
    137: ("NVLINK_PRIV_ERR", "IGNORE", "XID_137_FLOW"),
    139: ("ROBUST_CHANNEL_OFA1_ERROR", "RESTART_APP", "CONTACT_SUPPORT"),
    140: ("UNRECOVERABLE_ECC_ERROR_ESCAPE", "RESET_GPU", "CONTACT_SUPPORT"),
    141: ("ROBUST_CHANNEL_FAST_PATH_ERROR", "IGNORE", "CONTACT_SUPPORT"),
    142: ("ROBUST_CHANNEL_NVENC3_ERROR", "CONTACT_SUPPORT", ""),
    143: ("GPU_INIT_ERROR", "RESET_GPU", "CONTACT_SUPPORT"),
    144: ("NVLINK_SAW_ERROR", "WORKFLOW_NVLINK5_ERR", "WORKFLOW_NVLINK5_ERR"),
    145: ("NVLINK_RLW_ERROR", "WORKFLOW_NVLINK5_ERR", "WORKFLOW_NVLINK5_ERR"),
    146: ("NVLINK_TLW_ERROR", "WORKFLOW_NVLINK5_ERR", "WORKFLOW_NVLINK5_ERR"),
    147: ("NVLINK_TREX_ERROR", "WORKFLOW_NVLINK5_ERR", "WORKFLOW_NVLINK5_ERR"),
    148: ("NVLINK_NVLPW_CTRL_ERROR", "WORKFLOW_NVLINK5_ERR", "WORKFLOW_NVLINK5_ERR"),
    149: ("NVLINK_NETIR_ERROR", "WORKFLOW_NVLINK5_ERR", "WORKFLOW_NVLINK5_ERR"),
    150: ("NVLINK_MSE_ERROR", "WORKFLOW_NVLINK5_ERR", "WORKFLOW_NVLINK5_ERR"),
    151: ("ROBUST_CHANNEL_KEY_ROTATION_ERROR", "RESTART_VM", "CONTACT_SUPPORT"),
    152: ("ROBUST_CHANNEL_DLA_SMMU_ERROR", "IGNORE", "CONTACT_SUPPORT"),
    153: ("ROBUST_CHANNEL_DLA_TIMEOUT", "IGNORE", "CONTACT_SUPPORT"),
    154: ("GPU_RECOVERY_ACTION_CHANGED", "XID_154", ""),
    155: ("NVLINK_SW_DEFINED_ERROR", "RESET_GPU", "INVESTIGATE_SW_USER"),
    156: ("RESOURCE_RETIREMENT_EVENT", "RESET_GPU", "IGNORE"),
    157: ("RESOURCE_RETIREMENT_FAILURE", "IGNORE", "CONTACT_SUPPORT"),
    158: ("GPU_FATAL_TIMEOUT", "RESET_GPU", "CONTACT_SUPPORT"),
    159: ("ROBUST_CHANNEL_CHI_NON_DATA_ERROR", "CHECK_UVM", ""),
    160: ("CHANNEL_RETIREMENT_EVENT", "IGNORE", "INVESTIGATE_SW"),
    161: ("CHANNEL_RETIREMENT_FAILURE", "IGNORE", "INVESTIGATE_SW"),
    # 162-172 are listed with no resolution bucket yet: classified like an unknown code.
    162: ("PSHC_REENGAGED", "", ""),
    163: ("PSHC_DISENGAGED", "", ""),
    164: ("PSHC_LOW_LIFETIME", "", ""),
    165: ("PSHC_ZERO_LIFETIME", "", ""),
    166: ("NVLINK_SECURE_CRYPTO_ERR", "", ""),
    167: ("PCIE_FATAL_TIMEOUT", "", ""),
    168: ("REDUCED_GPU_MEMORY_CAPACITY", "", ""),
    169: ("SEC2_HALT_ERROR", "", ""),
    170: ("NVLINK_SECURE_OTHER", "", ""),
    171: ("UNCORRECTABLE_DRAM_ERROR", "", ""),
    172: ("UNCORRECTABLE_SRAM_ERROR", "", ""),
}

# Rows the catalogue marks "Unused" on A100/H100/B100/GB200 (immediate action CONTACT_SUPPORT).
_UNUSED_CODES = (
    *range(1, 8),
    9,
    10,
    12,
    *range(15, 25),
    *range(26, 31),
    *range(33, 37),
    42,
    47,
    *range(49, 54),
    *range(55, 60),
    61,
    65,
    73,
    81,
    87,
    90,
    91,
    *range(111, 119),
    *range(122, 126),
    138,
)
for _code in _UNUSED_CODES:
    _CATALOGUE.setdefault(_code, ("UNUSED", _UNUSED, "N/A"))

_FATAL_BUCKETS = {"RESTART_BM", "WORKFLOW_XID_48", "WORKFLOW_NVLINK_ERR"}
_INFO_BUCKETS = {"IGNORE"}

# Xid 154's message names the recovery action the driver computed for the Xids it accompanies:
# "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)". The catalogue
# lists the labels None, Drain P2P, Drain and Reset, GPU Reset Required, Node Reboot Required.
_XID_154_LABELS: dict[str, Resolution] = {
    "none": Resolution.INFO,
    "drain p2p": Resolution.RESET_GPU,
    "drain and reset": Resolution.RESET_GPU,
    "gpu reset required": Resolution.RESET_GPU,
    "node reboot required": Resolution.FATAL,
}
_XID_154_TO = re.compile(r"\bto\s+0x[0-9a-fA-F]+\s*\(([^)]*)\)")


def _resolution_from_buckets(xid: int, immediate: str, investigatory: str) -> Resolution:
    if xid in _OVERRIDES:
        return _OVERRIDES[xid]
    if immediate in _FATAL_BUCKETS:
        return Resolution.FATAL
    if immediate == "RESTART_APP":
        return Resolution.APPLICATION if investigatory in _APPLICATION_INVESTIGATION else Resolution.INFO
    if immediate == "WORKFLOW_XID_45":
        return Resolution.APPLICATION
    if immediate in _INFO_BUCKETS:
        return Resolution.INFO
    # RESET_GPU, RESTART_VM, UPDATE_SWFW, CHECK_MECHANICALS, CHECK_UVM, CONTACT_SUPPORT,
    # WORKFLOW_NVLINK5_ERR, XID_154 without a label, and no bucket at all.
    return Resolution.RESET_GPU


def xid_154_resolution(message: str | None) -> Resolution:
    """The resolution Xid 154's message asks for (``reset_gpu`` when it names no known label).

    Args:
        message: the Xid line's text, e.g. ``"GPU recovery action changed from 0x0 (None) to
            0x2 (Node Reboot Required)"``; None or unparseable -> ``reset_gpu``.
    """
    if message:
        found = _XID_154_TO.search(message)
        if found:
            return _XID_154_LABELS.get(found.group(1).strip().lower(), Resolution.RESET_GPU)
    return Resolution.RESET_GPU


def classify_xid(xid: int, message: str | None = None) -> XidClass:
    """Classify one Xid by NVIDIA's catalogue (rule and source: the module docstring).

    Args:
        xid: the Xid number (int; a numeric string is accepted, anything else is unknown).
        message: the Xid line's text; read only for Xid 154, whose message carries the recovery
            action the driver computed (``"... to 0x2 (Node Reboot Required)"``).

    Returns an :class:`XidClass`; never raises. An XID the catalogue does not list is
    ``reset_gpu`` with ``known=False``.
    """
    try:
        number = int(xid)
    except (TypeError, ValueError):
        return XidClass(xid=-1, mnemonic="UNKNOWN", immediate_action="", resolution=Resolution.RESET_GPU, known=False)
    row = _CATALOGUE.get(number)
    if row is None:
        return XidClass(
            xid=number, mnemonic="UNKNOWN", immediate_action="", resolution=Resolution.RESET_GPU, known=False
        )
    mnemonic, immediate, investigatory = row
    if number == 154:
        resolution = xid_154_resolution(message)
    else:
        resolution = _resolution_from_buckets(number, immediate, investigatory)
    return XidClass(xid=number, mnemonic=mnemonic, immediate_action=immediate, resolution=resolution)


def catalogue() -> dict[int, XidClass]:
    """Every code the catalogue lists, classified (for docs, admin and tests)."""
    return {xid: classify_xid(xid) for xid in sorted(_CATALOGUE)}


def worst(classes: list[XidClass]) -> XidClass | None:
    """The most severe of ``classes`` (fatal > reset_gpu > info > application), None if empty."""
    order = [Resolution.APPLICATION, Resolution.INFO, Resolution.RESET_GPU, Resolution.FATAL]
    return max(classes, key=lambda c: order.index(c.resolution), default=None)
