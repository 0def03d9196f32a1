"""The provider interface: how a pool's machines are created and deleted.

A provider is a small object with two methods (:class:`Provider`). Two ship:

* ``simulated`` starts one simulator process per machine (``python -m simulator.machine``) that
  enrolls through the real API with the machine's single-use bootstrap token and then heartbeats
  like any node; deleting the machine stops the process.
* ``webhook`` POSTs a signed JSON scale request to the operator's URL, which creates or deletes
  machines however it likes. Each request is signed with HMAC-SHA256 over ``<timestamp>.<body>``
  with the pool's secret (the scheme of Stripe's and GitHub's webhooks), carries a unique
  ``delivery_id`` inside the signed body, and the receiver refuses stale timestamps and delivery
  ids it has seen (replays). :func:`verify` is that receiver check; nodepool uses it itself for
  notices providers send back (preemption notices).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from django.db import IntegrityError, transaction
from django.utils import timezone

from nodepool import egress
from nodepool.api.errors import INVALID_BODY
from nodepool.quantity import format_quantity

from . import conf
from .choices import ProviderKind
from .errors import REPLAYED, SIGNATURE_EXPIRED, SIGNATURE_INVALID, SIGNATURE_MISSING
from .models import SeenDelivery

TIMESTAMP_HEADER = "X-Nodepool-Timestamp"
SIGNATURE_HEADER = "X-Nodepool-Signature"
DELIVERY_HEADER = "X-Nodepool-Delivery"
ROOT = Path(__file__).resolve().parent.parent


class ProviderError(Exception):
    """The provider failed or timed out; nothing it was asked for may be assumed to exist."""


@dataclass
class MachineRequest:
    """One machine to create: its name, the single-use bootstrap token it enrolls with, its shape."""

    name: str
    bootstrap_token: str
    template: dict
    version: str = ""
    provider_data: dict = field(default_factory=dict)


class Provider(Protocol):
    kind: str

    def create(self, machines: list[MachineRequest]) -> dict[str, dict]:
        """Create ``machines``; returns ``{name: provider_data}``. Raises ProviderError."""

    def delete(self, name: str, provider_data: dict) -> None:
        """Delete one machine (gone already is fine). Raises ProviderError."""


# --- signing -------------------------------------------------------------------------------------
def signature(secret: str, timestamp: str, body: bytes) -> str:
    """``sha256=<hex HMAC-SHA256(secret, timestamp + "." + body)>``."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def signed_headers(secret: str, body: bytes, delivery_id: str, *, now: float | None = None) -> dict[str, str]:
    timestamp = str(int(now if now is not None else time.time()))
    return {
        "Content-Type": "application/json",
        TIMESTAMP_HEADER: timestamp,
        DELIVERY_HEADER: delivery_id,
        SIGNATURE_HEADER: signature(secret, timestamp, body),
    }


class SignatureError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def verify(secret: str, headers, body: bytes, *, now: float | None = None, remember: bool = True) -> dict:
    """Check a signed request; returns its JSON body.

    Refuses (``SignatureError`` with a code): a missing header (``signature_missing``), a
    timestamp outside ``WEBHOOK_TOLERANCE`` seconds (``signature_expired``), a wrong signature
    (``signature_invalid``, compared in constant time), a body that is not a JSON object with a
    ``delivery_id`` equal to the header (``invalid_body``), and a delivery id already accepted
    (``replayed``; remembered in :class:`operations.models.SeenDelivery` when ``remember``).
    """

    timestamp, given = headers.get(TIMESTAMP_HEADER), headers.get(SIGNATURE_HEADER)
    delivery = headers.get(DELIVERY_HEADER)
    if not secret or not timestamp or not given or not delivery:
        raise SignatureError(SIGNATURE_MISSING, "The request is not signed.")
    try:
        age = abs((now if now is not None else time.time()) - int(timestamp))
    except ValueError:
        raise SignatureError(SIGNATURE_INVALID, "The timestamp is not an integer.") from None
    if age > int(conf.get("WEBHOOK_TOLERANCE")):
        raise SignatureError(SIGNATURE_EXPIRED, "The signature's timestamp is too old or in the future.")
    if not hmac.compare_digest(signature(secret, timestamp, body), given):
        raise SignatureError(SIGNATURE_INVALID, "The signature does not match.")
    try:
        data = json.loads(body)
    except ValueError:
        raise SignatureError(INVALID_BODY, "The body is not JSON.") from None
    if not isinstance(data, dict) or data.get("delivery_id") != delivery:
        raise SignatureError(INVALID_BODY, "The body must be an object whose delivery_id matches the header.")
    if remember:
        SeenDelivery.objects.filter(seen_at__lt=timezone.now() - timedelta(days=1)).delete()
        try:
            with transaction.atomic():  # a savepoint: the refused insert must not break the caller's transaction
                SeenDelivery.objects.create(delivery_id=str(delivery)[:64], seen_at=timezone.now())
        except IntegrityError:
            raise SignatureError(REPLAYED, "This delivery was already accepted.") from None
    return data


# --- webhook ---------------------------------------------------------------------------------------
def template_on_the_wire(template: dict) -> dict:
    """The node template in the operator's units, as it was written (``{"cpu": "8", "memory":
    "32Gi"}``), not the canonical integers stored (millicores, bytes): a provider that copies it
    into the machine's declared capacity then declares what admission expects."""
    template = dict(template or {})
    template["resources"] = {
        name: format_quantity(name, int(amount)) for name, amount in (template.get("resources") or {}).items()
    }
    return template


class WebhookProvider:
    """POSTs ``{"delivery_id", "action": "create"|"delete", "pool", "machines": [...], "sent_at"}``.

    ``create`` machines carry ``name``, ``bootstrap_token`` (single use), ``template`` and
    ``version``. A 2xx answer is success; its JSON may map machine names to provider data
    (``{"machines": {name: {...}}}``). Anything else, or no answer within ``PROVIDER_TIMEOUT``,
    is a :class:`ProviderError` whose text is a fixed summary (never the answer's body). The call
    goes through :func:`nodepool.egress.post_json`: destinations outside ``NODEPOOL_EGRESS_ALLOW``
    that are not public are refused, redirects are not followed.
    """

    kind = ProviderKind.WEBHOOK

    def __init__(self, *, pool_name: str, url: str, secret: str):
        self.pool_name, self.url, self.secret = pool_name, url, secret

    def _post(self, action: str, machines: list[dict]) -> dict:
        delivery = uuid.uuid4().hex
        body = json.dumps(
            {
                "delivery_id": delivery,
                "action": action,
                "pool": self.pool_name,
                "machines": machines,
                "sent_at": timezone.now().isoformat(),
            },
            separators=(",", ":"),
        ).encode()
        try:
            response = egress.post_json(
                self.url,
                body,
                headers=signed_headers(self.secret, body, delivery),
                timeout=float(conf.get("PROVIDER_TIMEOUT")),
            ).raise_for_status()
        except egress.EgressError as exc:
            # A fixed summary (status code and phrase, "timed out"...), never the remote body.
            raise ProviderError(f"webhook {action}: {exc.summary}") from exc
        answer = response.json()
        return answer if isinstance(answer, dict) else {}

    def create(self, machines: list[MachineRequest]) -> dict[str, dict]:
        answer = self._post(
            "create",
            [
                {
                    "name": m.name,
                    "bootstrap_token": m.bootstrap_token,
                    "template": template_on_the_wire(m.template),
                    "version": m.version,
                }
                for m in machines
            ],
        )
        data = answer.get("machines") if isinstance(answer.get("machines"), dict) else {}
        return {m.name: data.get(m.name) if isinstance(data.get(m.name), dict) else {} for m in machines}

    def delete(self, name: str, provider_data: dict) -> None:
        self._post("delete", [{"name": name, "provider_data": provider_data}])


# --- simulated -------------------------------------------------------------------------------------
class SimulatedProvider:
    """Starts ``python -m simulator.machine`` per machine (the token goes through the environment,
    never the command line), and stops it on delete. The control plane URL is the pool's
    ``provider_url`` or ``NODEPOOL["SIMULATED_PROVIDER_URL"]``."""

    kind = ProviderKind.SIMULATED

    def __init__(self, *, url: str, log_dir: Path | None = None):
        self.url = url
        self.log_dir = log_dir

    def create(self, machines: list[MachineRequest]) -> dict[str, dict]:
        started: dict[str, dict] = {}
        try:
            for machine in machines:
                started[machine.name] = self._start(machine)
        except OSError as exc:
            for name, data in started.items():  # no half-done state: stop what did start
                self.delete(name, data)
            raise ProviderError(f"simulated: could not start a machine: {exc}") from exc
        return started

    def _start(self, machine: MachineRequest) -> dict:
        resources = (machine.template or {}).get("resources") or {}
        args = [
            sys.executable,
            "-m",
            "simulator.machine",
            "--url",
            self.url,
            "--name",
            machine.name,
            "--cpu-millicores",
            str(int(resources.get("cpu", 2000))),
            "--memory-bytes",
            str(int(resources.get("memory", 4 * 2**30))),
            "--labels",
            json.dumps((machine.template or {}).get("labels") or {}),
        ]
        if machine.version:
            args += ["--version", machine.version]
        if int(resources.get("nvidia.com/gpu", 0) or 0):  # a GPU template: a machine with devices
            args += ["--gpus", str(int(resources["nvidia.com/gpu"]))]
        env = {**os.environ, "NODEPOOL_BOOTSTRAP_TOKEN": machine.bootstrap_token}
        log_dir = self.log_dir or Path(os.environ.get("NODEPOOL_VAR_DIR", ROOT / "var"))
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"machine-{machine.name}.log", "ab") as log:
            proc = subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return {"pid": proc.pid, "name": machine.name}

    def delete(self, name: str, provider_data: dict) -> None:
        pid = provider_data.get("pid")
        if not isinstance(pid, int) or not _is_machine(pid, name):
            return  # gone already (or the pid now belongs to something else: leave it alone)
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        except OSError as exc:
            raise ProviderError(f"simulated: could not stop {name}: {exc}") from exc


def _is_machine(pid: int, name: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"simulator.machine" in cmdline and name.encode() in cmdline


def provider_for(ops) -> Provider:
    """The provider configured on ``ops`` (a PoolOperations). Raises ProviderError if none."""
    if ops.provider == ProviderKind.SIMULATED:
        return SimulatedProvider(url=ops.provider_url or str(conf.get("SIMULATED_PROVIDER_URL")))
    if ops.provider == ProviderKind.WEBHOOK:
        if not ops.provider_url or not ops.provider_secret:
            raise ProviderError("the webhook provider needs provider_url and provider_secret")
        return WebhookProvider(pool_name=ops.pool.name, url=ops.provider_url, secret=ops.provider_secret)
    raise ProviderError("the pool has no provider")
