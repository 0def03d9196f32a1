"""XID events: not in any ``nvidia-smi`` query, so read from one of two sources behind
:class:`XidSource` (agent.nvidia's docstring says which needs what privilege):
:class:`NvmlXidListener` (NVML's critical-error events, on a thread) or :class:`KernelLogXids`
(the driver's ``NVRM: Xid`` lines in ``/dev/kmsg``). Split from agent/nvidia.py (issue 28 step 8).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from datetime import UTC, datetime

import psutil

log = logging.getLogger("agent.nvidia")  # the name these sources logged under in agent.nvidia


def _rfc3339(ts: float | None = None) -> str:
    return datetime.fromtimestamp(ts if ts is not None else datetime.now(UTC).timestamp(), UTC).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ"
    )


_XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F:.]+)\):\s*(\d+),?\s*(.*)$")


def parse_xid_line(line: str) -> dict | None:
    """``NVRM: Xid (PCI:0000:17:00): 79, pid=..., GPU has fallen off the bus.`` ->
    ``{"xid": 79, "pci_bus_id": "0000:17:00", "message": "pid=..., GPU has fallen off the bus."}``."""
    found = _XID_LINE.search(line)
    if not found:
        return None
    return {"xid": int(found.group(2)), "pci_bus_id": found.group(1), "message": found.group(3).strip()[:500]}


class XidSource:
    """Where XID events come from; ``drain()`` returns those seen since the last call."""

    name = "none"

    def drain(self) -> list[dict]:
        return []

    def close(self) -> None:
        """Stop any thread or file the source holds."""


class KernelLogXids(XidSource):
    """``NVRM: Xid`` lines from ``/dev/kmsg`` (needs CAP_SYSLOG where dmesg is restricted).

    Opens the device non-blocking and seeks to its end, so only lines logged after the agent
    started count; each ``drain`` reads what arrived since. Records are
    ``"<pri>,<seq>,<usec since boot>,<flags>;<text>"``.
    """

    name = "kmsg"

    def __init__(self, path: str = "/dev/kmsg", *, boot_time: float | None = None):
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with contextlib.suppress(OSError):
            os.lseek(self.fd, 0, os.SEEK_END)
        self.boot_time = boot_time if boot_time is not None else psutil.boot_time()

    def drain(self) -> list[dict]:
        events = []
        while True:
            try:
                record = os.read(self.fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:  # EPIPE: the ring overwrote records we had not read yet
                if exc.errno == 32:
                    continue
                raise
            if not record:
                break
            # /dev/kmsg gives one record per read; a pipe (tests) may give several: split on lines.
            # Lines starting with a space continue a record (KEY=value dictionary): skipped.
            for line in record.decode("utf-8", "replace").splitlines():
                if not line or line.startswith(" "):
                    continue
                head, _, text = line.partition(";")
                event = parse_xid_line(text)
                if event is None:
                    continue
                at = None
                with contextlib.suppress(IndexError, ValueError):
                    at = self.boot_time + int(head.split(",")[2]) / 1e6
                events.append({**event, "at": _rfc3339(at)})
        return events

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class NvmlXidListener(XidSource):
    """XID events from NVML (``nvidia-ml-py``'s ``pynvml``), waited for on a daemon thread.

    Args:
        nvml: the ``pynvml`` module (tests pass a fake with the same functions).
        wait_ms: how long one ``nvmlEventSetWait_v2`` blocks; the thread checks for ``close`` between.

    Raises whatever ``nvmlInit`` raises (no driver): the caller falls back to another source.
    """

    name = "nvml"

    def __init__(self, nvml=None, *, wait_ms: int = 1000):
        if nvml is None:
            import pynvml as nvml  # only where a driver may be present: optional at run time
        self.nvml = nvml
        self.wait_ms = wait_ms
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        nvml.nvmlInit()
        self.event_set = nvml.nvmlEventSetCreate()
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.event_set)
            except nvml.NVMLError as exc:  # e.g. NOT_SUPPORTED on a GPU that reports no events
                log.warning("GPU %s: no XID events from NVML: %s", i, exc)
        self.thread = threading.Thread(target=self._run, name="nvml-xid", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        nvml = self.nvml
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait_v2(self.event_set, self.wait_ms)
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_TIMEOUT", object()):
                    continue
                log.warning("NVML event wait failed: %s", exc)
                self._stop.wait(self.wait_ms / 1000)
                continue
            if data.eventType != nvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                uuid = nvml.nvmlDeviceGetUUID(data.device)
            except nvml.NVMLError:
                uuid = None
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            with self._lock:
                self._events.append(
                    {"xid": int(data.eventData), "device_id": uuid, "at": _rfc3339(), "message": "NVML XID event"}
                )
                del self._events[:-1024]

    def drain(self) -> list[dict]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=self.wait_ms / 1000 + 1)
        with contextlib.suppress(Exception):
            self.nvml.nvmlEventSetFree(self.event_set)
            self.nvml.nvmlShutdown()


def open_xid_source(choice: str = "auto") -> XidSource:
    """The XID source named by ``choice``: ``nvml``, ``kmsg``, ``none``, or ``auto`` (NVML, else
    the kernel log, else none). A source that cannot open is logged and replaced by none."""
    order = {"auto": ("nvml", "kmsg"), "nvml": ("nvml",), "kmsg": ("kmsg",), "none": ()}[choice]
    for name in order:
        try:
            return NvmlXidListener() if name == "nvml" else KernelLogXids()
        except Exception as exc:  # no driver, no module, no permission: say which, then go on
            log.info("XID source %s unavailable: %s", name, exc)
    if choice != "none":
        log.warning("no XID source: device health will carry no XID events")
    return XidSource()
