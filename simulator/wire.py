"""What the simulator's virtual nodes share: the wire's words (renewal flags, refusals that mean
"not yours"), times as the API writes them, a virtual lease, and the small helpers each part of a
node uses (split from simulator/node.py, issue 28 step 8)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import httpx

# Renewal flags (fleet.instructions): any bit but ROTATE_CREDENTIAL asks for a status report.
FLAG_ROTATE_CREDENTIAL = 16
# Lease event refusals that mean "this lease is not yours any more" (docs/api-contract.md).
NOT_OURS = {"stale_fencing_token", "lease_superseded", "stale_incarnation", "lease_ended", "not_found"}


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def parse_time(value) -> float | None:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp() if value else None
    except ValueError:
        return None


@dataclass
class VirtualLease:
    lease_id: str
    fencing_token: int
    command: list
    ends_at: float | None  # loop time when a ``sleep N`` command completes; None runs until stopped
    devices: tuple = ()  # the device ids the lease was given, in its order
    env: dict | None = None  # what the agent would set: CUDA_VISIBLE_DEVICES, NODEPOOL_DEVICES...


class Unavailable(Exception):
    pass


LEASE_EVENT_ATTEMPTS = 4  # a lease event is sent again after 0.5, 1 and 2 s (capped by max_backoff)


def healthy() -> dict:
    return {
        "ecc_uncorrectable": 0,
        "retired_pages_pending": False,
        "remapped_rows_failure": False,
        "thermal_throttle": False,
        "power_throttle": False,
    }


def error_code(response: httpx.Response) -> str:
    try:
        return str(response.json().get("code") or f"http_{response.status_code}")
    except ValueError:
        return f"http_{response.status_code}"


def sleep_seconds(command: list) -> float | None:
    """A ``["sleep", "N"]`` command completes after N seconds; anything else runs until stopped."""
    if len(command) == 2 and str(command[0]).rsplit("/", 1)[-1] == "sleep":
        try:
            return max(0.0, float(command[1]))
        except ValueError:
            return None
    return None
