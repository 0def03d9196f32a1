"""Benchmark baseline: a bare Django view that parses a JSON body and does one UPDATE.

Served only when ``NODEPOOL_BENCH=1`` (bench/common.py sets it); bench/heartbeats.py compares the
real heartbeat endpoint with it on the same gunicorn, so the figures are relative to this machine.
"""

from __future__ import annotations

import json

from django.db import connection
from django.http import HttpResponseBadRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST


@csrf_exempt
@require_POST
def one_update(request, pk):
    """Parse the body, UPDATE one node row (a heartbeat-shaped write), answer a small JSON."""
    try:
        body = json.loads(request.body)
    except ValueError:
        return HttpResponseBadRequest("bad json")
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE fleet_node SET last_heartbeat_at = %s, sequence = %s WHERE id = %s",
            [now, int(body.get("sequence", 0)), pk],
        )
    return JsonResponse({"applied": True, "server_time": now.isoformat()})
