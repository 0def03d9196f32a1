"""Spot preemption notices: how the agent learns that its machine is about to be reclaimed.

Two ways in, both ending in ``POST /nodes/{id}/preemption-notice {"deadline"}`` with the node's
credential (docs/pool-operations.md, "Spot pools"):

* ``nodepool-agent run --preemption-url URL``: the agent polls the cloud's instance metadata every
  ``--preemption-poll`` seconds (default 5) and sends the notice once, as soon as one appears. Two
  answers are understood, the formats of the clouds that publish them:

  - AWS EC2 ``/latest/meta-data/spot/instance-action``: ``404`` until a notice, then
    ``{"action": "terminate" | "stop" | "hibernate", "time": "2026-11-30T12:00:00Z"}``; the
    deadline is ``time`` (EC2 gives two minutes).
  - Google Compute Engine ``/computeMetadata/v1/instance/preempted`` (send
    ``--preemption-header "Metadata-Flavor: Google"``): ``FALSE``, then ``TRUE``; GCE gives 30 s,
    so the deadline is 30 s after the agent saw ``TRUE``.

* ``nodepool-agent preempt --in SECONDS`` (or ``--deadline TIME``), for everything else: a cloud's
  shutdown hook, Azure Scheduled Events, or a script that speaks IMDSv2. It reads the credential
  from the agent's state file, so it runs next to the agent, on the same machine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import httpx

from .times import parse_time

log = logging.getLogger("agent.preemption")

GCE_NOTICE_SECONDS = 30.0

# (now) -> the reclaim time as a UNIX timestamp, or None while there is no notice; ``now`` is the
# control plane's time as the agent knows it (local time + the offset its answers showed).
Probe = Callable[[float], float | None]


def parse_notice(status: int, body: str, *, now: float) -> float | None:
    """The reclaim time (UNIX seconds) an instance-metadata answer announces, or None.

    Args:
        status: the HTTP status of the metadata answer (404: no notice yet, on AWS).
        body: its text.
        now: the time the answer was read (UNIX seconds), for GCE's relative notice.

    Returns None for "no notice" and for anything not understood (logged once per poll at DEBUG).
    """
    if status != 200:
        return None
    text = body.strip()
    if text.upper() == "TRUE":
        return now + GCE_NOTICE_SECONDS
    if text.upper() == "FALSE" or not text:
        return None
    try:
        notice = json.loads(text)
    except ValueError:
        log.debug("preemption metadata not understood: %r", text[:200])
        return None

    when = parse_time(notice.get("time")) if isinstance(notice, dict) else None
    if when is None or notice.get("action") not in ("terminate", "stop", "hibernate"):
        log.debug("preemption metadata not understood: %r", text[:200])
        return None
    return when


def metadata_probe(url: str, *, headers: dict[str, str] | None = None, timeout: float = 2.0, transport=None) -> Probe:
    """A :data:`Probe` reading ``url`` (instance metadata) with ``headers``; an unreachable
    metadata service counts as "no notice" (the next poll tries again)."""
    client = httpx.Client(timeout=timeout, headers=headers or {}, transport=transport)

    def probe(now: float) -> float | None:
        try:
            response = client.get(url)
        except httpx.HTTPError as exc:
            log.debug("preemption metadata unreachable: %s", exc)
            return None
        return parse_notice(response.status_code, response.text, now=now)

    return probe
