"""The admission benchmark: a real CPU and memory measurement, run in subprocesses.

CPU: one worker process hashes (SHA-256 over a 4 KiB block) alone for ``seconds`` to give the
rate of one core; then one worker per usable CPU hashes at the same time, all starting at
the same wall-clock instant. ``cpu_millicores = 1000 * parallel rate / single-core rate``:
the number of cores that really work in parallel, which catches a host that declares more
CPUs than it has or whose CPUs are oversubscribed.

Memory: a worker process allocates ``memory_sample_bytes``, touches every page (so the kernel
must really back it) and then writes the whole buffer in 1 MiB blocks, timing both. The
reported ``memory_bytes`` is the kernel's (cgroup-capped) total, stated only when the touch
test succeeded; otherwise it is the largest sample that could be touched. The sample is kept
well below the available memory on purpose: a benchmark must not push a node into the
MemoryPressure it is supposed to detect.

Each worker is ``python -m agent.benchmark --cpu-worker|--memory-worker`` and prints one JSON
line, so the measurement never runs inside the agent process (no GIL, no fork of a threaded
process, and the memory is returned to the system when the worker exits).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time

import psutil

from . import inventory

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
BLOCK = 2**20


def _cpu_worker(seconds: float, start_at: float) -> dict:
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    block = os.urandom(4096)
    h = hashlib.sha256
    ops = 0
    begin = time.perf_counter()
    end = begin + seconds
    while True:
        for _ in range(200):
            block = h(block).digest() * 128
        ops += 200
        if time.perf_counter() >= end:
            break
    return {"ops": ops, "seconds": time.perf_counter() - begin}


def _memory_worker(size: int) -> dict:
    while size >= 16 * PAGE:
        try:
            t0 = time.perf_counter()
            buf = bytearray(size)
            pages = len(range(0, size, PAGE))
            buf[::PAGE] = b"\x01" * pages  # touch one byte per page: the kernel must back them all
            t1 = time.perf_counter()
            pattern = b"\xa5" * BLOCK
            for offset in range(0, size - BLOCK + 1, BLOCK):
                buf[offset : offset + BLOCK] = pattern
            t2 = time.perf_counter()
            ok = buf[PAGE * (pages // 2)] in (0x01, 0xA5)
            return {"touched_bytes": size, "touch_seconds": t1 - t0, "write_seconds": t2 - t1, "ok": ok}
        except MemoryError:
            size //= 2
    return {"touched_bytes": 0, "touch_seconds": 0.0, "write_seconds": 0.0, "ok": False}


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agent.benchmark", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": _pythonpath()},
    )


def _pythonpath() -> str:
    """The directory holding the ``agent`` package, so workers import the same code."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))


def _collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"benchmark worker exited {proc.returncode}: {err.strip()[-300:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def run_cpu(*, seconds: float = 1.0, workers: int | None = None) -> dict:
    """Measure parallel CPU capacity. Returns ``{"cpu_millicores", "single_core_ops_per_s", ...}``."""
    # ceil: under a 1.5-CPU quota two workers share 1.5 CPUs and measure them; one would measure 1.
    workers = workers or max(1, math.ceil(inventory.cpu_millicores() / 1000))
    # Other load on the host lowers the result (the CPUs are not free): say how busy it was.
    busy_before = psutil.cpu_percent(interval=0.2)
    lead = 0.5  # seconds for the interpreters to start before the common start instant
    single = _collect([_spawn(["--cpu-worker", str(seconds), str(time.time() + lead)])], timeout=seconds + 60)[0]
    start_at = time.time() + lead + 0.1 * workers
    parallel = _collect(
        [_spawn(["--cpu-worker", str(seconds), str(start_at)]) for _ in range(workers)], timeout=seconds + 120
    )
    single_rate = single["ops"] / single["seconds"]
    parallel_rate = sum(r["ops"] / r["seconds"] for r in parallel)
    return {
        "cpu_millicores": int(round(1000 * parallel_rate / single_rate)),
        "single_core_ops_per_s": round(single_rate, 1),
        "parallel_ops_per_s": round(parallel_rate, 1),
        "workers": workers,
        "cpu_seconds": seconds,
        "host_cpu_busy_percent_before": busy_before,
    }


def run_memory(*, sample_bytes: int | None = None) -> dict:
    """Allocate and touch ``sample_bytes`` (default: a quarter of available memory, at most 1 GiB)."""
    if sample_bytes is None:
        sample_bytes = min(2**30, psutil.virtual_memory().available // 4)
    result = _collect([_spawn(["--memory-worker", str(int(sample_bytes))])], timeout=300)[0]
    touched = result["touched_bytes"]
    confirmed = result["ok"] and touched >= sample_bytes
    write = result["write_seconds"]
    return {
        "memory_bytes": inventory.memory_bytes() if confirmed else touched,
        "memory_sample_bytes": touched,
        "memory_touch_seconds": round(result["touch_seconds"], 4),
        "memory_write_bytes_per_s": int(touched / write) if write > 0 else None,
        "memory_confirmed": confirmed,
    }


def run(
    *,
    cpu_seconds: float = 1.0,
    memory_sample_bytes: int | None = None,
    workers: int | None = None,
    limits: dict | None = None,
) -> dict:
    """The full benchmark as the body of ``POST /nodes/{id}/benchmarks/{nonce}``.

    ``limits`` (``{"cpu": millicores, "memory": bytes}``, from ``run_benchmark.limits``): a
    re-verification of a busy node, which must measure no more than its free capacity so that it
    never takes what running leases use: at most ``ceil(cpu / 1000)`` workers, a memory sample no
    larger than ``memory``, and figures capped at the limits.

    Returns ``{"cpu_millicores", "memory_bytes", "duration_seconds", "details": {...}}``.

    Raises:
        RuntimeError: a worker process failed.
    """
    limits = {k: int(v) for k, v in (limits or {}).items() if k in ("cpu", "memory") and isinstance(v, int) and v > 0}
    if "cpu" in limits:
        workers = min(workers or math.ceil(inventory.cpu_millicores() / 1000), max(1, math.ceil(limits["cpu"] / 1000)))
    if "memory" in limits:
        default = min(2**30, psutil.virtual_memory().available // 4)
        memory_sample_bytes = min(memory_sample_bytes or default, limits["memory"])
    t0 = time.monotonic()
    cpu = run_cpu(seconds=cpu_seconds, workers=workers)
    memory = run_memory(sample_bytes=memory_sample_bytes)
    return {
        "cpu_millicores": min(cpu.pop("cpu_millicores"), limits.get("cpu", 2**62)),
        "memory_bytes": min(memory.pop("memory_bytes"), limits.get("memory", 2**62)),
        "duration_seconds": round(time.monotonic() - t0, 3),
        "details": {**cpu, **memory, "method": "sha256 per core; page touch + block write", "limits": limits or None},
    }


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.benchmark")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--cpu-worker", nargs=2, metavar=("SECONDS", "START_AT"))
    group.add_argument("--memory-worker", metavar="BYTES")
    args = parser.parse_args(argv)
    if args.cpu_worker:
        print(json.dumps(_cpu_worker(float(args.cpu_worker[0]), float(args.cpu_worker[1]))))
    elif args.memory_worker:
        print(json.dumps(_memory_worker(int(args.memory_worker))))
    else:
        print(json.dumps(run(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
