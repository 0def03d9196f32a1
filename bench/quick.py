"""Run every benchmark's ``--quick`` smoke mode, one after the other (what CI runs).

    .venv/bin/python -m bench.quick [--budget 120] [--only NAME ...]

Benchmarks are discovered, not listed: every ``bench/*.py`` with a ``__main__`` block (so a new
bench is smoke-tested as soon as it lands). Each must accept ``--quick``, finish, exit 0 and end
with one JSON line (the figures every bench prints last). Fails (exit 1) on the first bench that
does not, and when the whole run takes longer than ``--budget`` seconds.

The benches use their own PostgreSQL databases (created if missing), never the test databases.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
NOT_BENCHES = {"__init__.py", "__main__.py", "common.py", "quick.py"}


def discover() -> list[Path]:
    """``bench/*.py`` scripts that run as programs (have ``if __name__ == "__main__"``), sorted."""
    return sorted(
        path
        for path in BENCH_DIR.glob("*.py")
        if path.name not in NOT_BENCHES and 'if __name__ == "__main__"' in path.read_text()
    )


def last_json_line(output: str) -> dict:
    """The figures: the last non-empty line of ``output``, parsed as a JSON object (ValueError if not)."""
    lines = [line for line in output.splitlines() if line.strip()]
    if not lines:
        raise ValueError("no output")
    figures = json.loads(lines[-1])
    if not isinstance(figures, dict):
        raise ValueError("the last line is JSON but not an object")
    return figures


def run(path: Path, *, timeout: float) -> tuple[float, dict]:
    """Run one bench with ``--quick``; returns ``(seconds, figures)``. Raises RuntimeError on failure."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(path), "--quick"], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{path.name} --quick did not finish in {timeout:.0f}s") from exc
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{path.name} --quick exited {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
    try:
        return seconds, last_json_line(done.stdout)
    except ValueError as exc:
        raise RuntimeError(f"{path.name} --quick did not end with a JSON line ({exc})\n{done.stdout[-2000:]}") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=120.0, help="seconds for all quick modes together")
    parser.add_argument("--only", nargs="*", default=None, help="bench names (file stems) to run")
    args = parser.parse_args(argv)
    benches = [p for p in discover() if args.only is None or p.stem in args.only]
    started = time.monotonic()
    for path in benches:
        remaining = args.budget - (time.monotonic() - started)
        try:
            seconds, figures = run(path, timeout=max(remaining, 1.0))
        except RuntimeError as exc:
            print(f"FAILED {exc}", flush=True)
            return 1
        print(f"ok {path.stem:12s} {seconds:5.1f}s  {len(figures)} figures", flush=True)
    total = time.monotonic() - started
    print(f"{len(benches)} quick benches in {total:.1f}s (budget {args.budget:.0f}s)")
    return 0 if total <= args.budget else 1


if __name__ == "__main__":
    sys.exit(main())
