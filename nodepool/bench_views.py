"""Benchmark baselines: bare Django views (no DRF, no authentication) doing the bare write.

* ``POST /bench/one-update/<node id>``: parse the JSON body, one UPDATE of the node row (a
  heartbeat-shaped write). bench/heartbeats.py compares the real heartbeat endpoints with it.
* ``POST /bench/one-grant``: parse the JSON body, then in one transaction the conditional
  capacity UPDATE and the INSERT of a lease row (a grant-shaped write). bench/placement.py
  compares ``POST /api/v1/node-leases`` with it.

Mounted only when ``NODEPOOL_BENCH=1`` (the benches' own setting, which bench/common.py sets; never
tied to ``DEBUG``, since the benches run with ``DEBUG=0``), and even then answered only to loopback
clients: they write raw SQL without authentication. The benches drive them on the same gunicorn as
the real endpoints, in the same run, so the figures are relative to this machine.

Raw SQL rather than the ORM, also for the lease row: this module is plumbing and may not import
the leases app (pyproject.toml's layers), and the barer the baseline, the stricter the ratio.
"""

from __future__ import annotations

import ipaddress
import json
import uuid
from datetime import timedelta

from django.db import connection, transaction
from django.http import Http404, HttpResponseBadRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST


@csrf_exempt
@require_POST
def one_update(request, pk):
    """Parse the body, UPDATE one node row (a heartbeat-shaped write), answer a small JSON.

    Raises Http404 for a client that is not on loopback (``REMOTE_ADDR`` outside 127.0.0.0/8, ::1).
    """
    if not is_loopback(request.META.get("REMOTE_ADDR", "")):
        raise Http404("not found")
    try:
        body = json.loads(request.body)
    except ValueError:
        return HttpResponseBadRequest("bad json")
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE fleet_node SET last_heartbeat_at = %s, sequence = %s WHERE id = %s",
            # Django's UUIDField stores 32 hex digits on SQLite and a native uuid on PostgreSQL.
            [now, int(body.get("sequence", 0)), str(pk) if connection.vendor == "postgresql" else pk.hex],
        )
    return JsonResponse({"applied": True, "server_time": now.isoformat()})


GRANT_TTL_SECONDS = 600

# The columns the real grant writes (leases.grant._reserve via Lease.objects.create) that have
# no default in the table; pool and incarnation come from the node row, as in the real grant.
INSERT_LEASE = """
INSERT INTO leases_lease (id, workload_id, fencing_token, node_id, node_incarnation, pool_id, state, workload_state,
  resources, "group", priority, command, spec, decision, ttl_seconds, expires_at, granted_at, end_reason, outcome,
  missed_reports, idempotency_key, request_hash, version, devices)
SELECT %s, %s, 1, id, incarnation, pool_id, 'granted', '', %s, '', 0, '[]', %s, '{}', %s, %s, %s, '', '', 0, '', '', 1,
  '[]' FROM fleet_node WHERE id = %s
"""


@csrf_exempt
@require_POST
def one_grant(request):
    """Parse ``{"workload_id", "resource", "amount"}``, then one transaction: reserve ``amount`` on
    the ``NodeResource`` row ``resource`` (``UPDATE … SET allocated = allocated + amount WHERE id = …
    AND allocated + amount <= allocatable``) and INSERT a granted lease of ``{name: amount}`` on its
    node. Answers 201 ``{"lease_id", "node_id"}``, or 409 ``{"granted": false}`` when the row has no
    room (nothing written).

    Raises Http404 for a client that is not on loopback (``REMOTE_ADDR`` outside 127.0.0.0/8, ::1).
    """
    if not is_loopback(request.META.get("REMOTE_ADDR", "")):
        raise Http404("not found")
    try:
        body = json.loads(request.body)
        workload_id, resource, amount = str(body["workload_id"]), int(body["resource"]), int(body["amount"])
    except (ValueError, KeyError, TypeError):
        return HttpResponseBadRequest("bad json")
    now = timezone.now()
    lease_id = uuid.uuid4()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "UPDATE fleet_noderesource SET allocated = allocated + %s "
            "WHERE id = %s AND allocated + %s <= allocatable RETURNING node_id, name",
            [amount, resource, amount],
        )
        row = cursor.fetchone()
        if row is None:
            return JsonResponse({"granted": False}, status=409)
        node_id, name = row
        ops = connection.ops
        cursor.execute(
            INSERT_LEASE,
            [
                # Django's UUIDField stores 32 hex digits on SQLite and a native uuid on PostgreSQL.
                str(lease_id) if connection.vendor == "postgresql" else lease_id.hex,
                workload_id,
                json.dumps({name: amount}),
                json.dumps(body),
                GRANT_TTL_SECONDS,
                ops.adapt_datetimefield_value(now + timedelta(seconds=GRANT_TTL_SECONDS)),
                ops.adapt_datetimefield_value(now),
                node_id,
            ],
        )
    return JsonResponse({"lease_id": str(lease_id), "node_id": str(uuid.UUID(str(node_id)))}, status=201)


def is_loopback(address: str) -> bool:
    """True for a loopback IP address (``127.0.0.0/8``, ``::1``); False for anything else or garbage."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
