"""Structured logs: a heartbeat's log line carries the node and request ids; JSON or text output;
Celery tasks carry the originating request id."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from nodepool.structured_logs import logging_config
from tests.factories import PoolFactory, make_schedulable_node
from tests.heartbeat_support import beat, node_api, post_beat

pytestmark = pytest.mark.django_db


def finished_lines(caplog) -> list[dict]:
    return [r.msg for r in caplog.records if isinstance(r.msg, dict) and r.msg.get("event") == "request_finished"]


def test_a_heartbeat_log_line_carries_the_node_and_request_ids(caplog):
    node, secret = make_schedulable_node(PoolFactory(name="edge"))
    api = node_api(secret)
    with caplog.at_level(logging.INFO):
        response = api.post(
            f"/api/v1/nodes/{node.pk}/heartbeats",
            beat(),
            format="json",
            HTTP_X_REQUEST_ID="req-hb-0001",
        )
    assert response.status_code == 200, response.json()
    assert response["X-Request-ID"] == "req-hb-0001"
    (line,) = finished_lines(caplog)
    assert line["request_id"] == "req-hb-0001"
    assert line["node_id"] == str(node.pk)
    assert line["incarnation"] == "1" and line["pool"] == "edge"
    assert line["code"] == 200


def test_an_invalid_request_id_is_replaced_and_the_log_uses_the_one_echoed_back(caplog):
    node, secret = make_schedulable_node(PoolFactory(name="edge"))
    with caplog.at_level(logging.INFO):
        response = post_beat(node_api(secret), node)
    (line,) = finished_lines(caplog)
    assert line["request_id"] == response["X-Request-ID"]


def test_a_lease_grant_logs_lease_workload_and_pool(client_api, caplog):
    make_schedulable_node(PoolFactory(name="general"))
    with caplog.at_level(logging.INFO):
        response = client_api.post(
            "/api/v1/node-leases", {"workload_id": "train-9", "pool": "general", "resources": {"cpu": "1"}}
        )
    assert response.status_code == 201
    (line,) = finished_lines(caplog)
    assert (line["lease_id"], line["workload_id"], line["pool"]) == (response.json()["id"], "train-9", "general")


def render(fmt: str, **fields) -> str:
    """Format one stdlib record through the configured formatter of ``fmt``."""
    config = logging_config(fmt)["formatters"]["structured"]
    formatter = config["()"](processors=config["processors"], foreign_pre_chain=config["foreign_pre_chain"])
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**fields)
    try:
        record = logging.LogRecord("nodepool.test", logging.INFO, __file__, 1, "lease_granted", None, None)
        return formatter.format(record)
    finally:
        structlog.contextvars.clear_contextvars()


def test_json_format_is_one_object_per_line_with_the_ids_as_fields():
    line = json.loads(render("json", request_id="r-1", node_id="n-1"))
    assert line["event"] == "lease_granted" and line["request_id"] == "r-1" and line["node_id"] == "n-1"
    assert line["level"] == "info" and line["timestamp"].endswith("Z")


def test_text_format_is_readable_key_value_text():
    line = render("text", request_id="r-1")
    assert "lease_granted" in line and "request_id=r-1" in line
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


def test_an_unknown_log_format_is_refused():
    with pytest.raises(ValueError, match="LOG_FORMAT"):
        logging_config("xml")


def test_a_task_sent_during_a_request_carries_its_request_id():
    from django_structlog.celery.receivers import CeleryReceiver

    structlog.contextvars.bind_contextvars(request_id="req-task-7", node_id="n-7")
    try:
        headers: dict = {}
        CeleryReceiver().receiver_before_task_publish(headers=headers, properties={})
    finally:
        structlog.contextvars.clear_contextvars()
    assert headers["__django_structlog__"]["request_id"] == "req-task-7"


def test_applied_renewals_and_429s_log_at_debug_other_renewal_answers_at_their_level(caplog, settings):
    """A fleet renews ~1,000 times a second: applied renewals and refusals of a flood are counted
    (nodepool_heartbeats_total), not logged at INFO (nodepool.logs.RoutineMachineTraffic)."""
    import json as json_module

    from django.test import Client

    from fleet.renewals import forget_cached_timings

    settings.NODEPOOL = {**settings.NODEPOOL, "MIN_SPACING_FRACTION": 0.5}
    forget_cached_timings()
    node, secret = make_schedulable_node(PoolFactory(name="edge"))

    def renew(sequence, credential=secret):
        return Client().post(
            f"/api/v1/nodes/{node.pk}/renewals",
            json_module.dumps({"incarnation": 1, "sequence": sequence}),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Node {credential}",
        )

    with caplog.at_level(logging.INFO):
        assert renew(1).status_code == 200
        assert renew(2).status_code == 429  # sooner than half the interval
        assert renew(3, credential=secret[:-4] + "AAAA").status_code == 401
    assert [line["code"] for line in finished_lines(caplog)] == [401]
    with caplog.at_level(logging.DEBUG):
        caplog.clear()
        forget_cached_timings()
        assert renew(4).status_code == 429
    finished = [r for r in caplog.records if isinstance(r.msg, dict) and r.msg.get("event") == "request_finished"]
    assert [(r.msg["code"], r.levelname) for r in finished] == [(429, "DEBUG")]
