"""POST /api/v1/nodes/{id}/heartbeats: ordering, restarts, time, bounds, instructions, events."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from fleet import event_types as fleet_events
from fleet.choices import Health, Lifecycle, Liveness
from fleet.credentials import issue_credential
from fleet.liveness_sweep import sweep_liveness
from fleet.models import Benchmark, Node, NodeEvent
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node, set_lifecycle
from tests.heartbeat_support import T0, beat, node_api, post_beat, seconds

# Ordering and liveness tests send messages back to back; the flood guard has its own tests.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_flood_guard", "clock_at_t0")]


@pytest.fixture
def node_secret():
    return make_schedulable_node(PoolFactory(name="general"))


def events(node, type=None):
    qs = NodeEvent.objects.filter(node=node)
    return list(qs.filter(type=type) if type else qs)


def test_first_heartbeat_is_applied_and_makes_a_never_heard_node_alive():
    node = NodeFactory()
    _, secret = issue_credential(node=node, issuer="test")
    response = post_beat(node_api(secret), node, sequence=0)
    assert response.status_code == 200
    body = response.json()
    assert body["applied"] is True and body["code"] == "applied"
    assert body["liveness"] == "alive"
    assert body["lifecycle"] == "pending"
    assert body["renewal_interval"] == 10 and 6 <= body["next_heartbeat_in"] <= 14  # the node's slot
    assert body["instructions"] == {
        "stop_leases": [],
        "checkpoint_leases": [],
        "run_benchmark": None,
        "rotate_credential": False,
    }
    node.refresh_from_db()
    assert node.liveness == Liveness.ALIVE and node.last_heartbeat_at == T0
    assert node.next_liveness_check_at == T0 + seconds(20)
    assert node.health == Health.HEALTHY and node.ready is True
    assert [e.to_state for e in events(node, fleet_events.LIVENESS)] == ["alive"]


def test_duplicate_heartbeat_changes_nothing_and_says_so(node_secret, time_machine):
    node, secret = node_secret
    api = node_api(secret)
    assert post_beat(api, node, sequence=1).json()["applied"] is True
    before = NodeEvent.objects.count()
    time_machine.shift(3)
    response = post_beat(api, node, sequence=1, usage={"cpu": 7000})
    assert response.status_code == 200
    assert response.json()["applied"] is False and response.json()["code"] == "duplicate_sequence"
    node.refresh_from_db()
    assert node.usage["cpu"] == 1200 and node.last_heartbeat_at == T0
    assert NodeEvent.objects.count() == before


def test_reordered_heartbeat_with_lower_sequence_is_ignored(node_secret):
    node, secret = node_secret
    api = node_api(secret)
    assert post_beat(api, node, sequence=5, usage={"cpu": 500}).json()["applied"] is True
    response = post_beat(api, node, sequence=3, usage={"cpu": 3000})
    assert response.json()["code"] == "stale_sequence" and response.json()["applied"] is False
    node.refresh_from_db()
    assert node.sequence == 5 and node.usage == {"cpu": 500}


def test_older_incarnation_after_a_newer_one_can_never_overwrite_it(node_secret):
    node, secret = node_secret
    api = node_api(secret)
    assert post_beat(api, node, incarnation=2, sequence=0).json()["applied"] is True
    response = post_beat(api, node, incarnation=1, sequence=999, ready=False)
    assert response.json()["code"] == "stale_incarnation"
    node.refresh_from_db()
    assert (node.incarnation, node.sequence, node.ready) == (2, 0, True)


def test_higher_incarnation_is_a_restart_with_an_event_a_counter_and_lease_reconciliation(node_secret, monkeypatch):
    node, secret = node_secret
    calls = []

    def reconcile(node, *, incarnation, reported, restarted, actor):
        calls.append((incarnation, reported, restarted))
        return {"stop": ["11111111-1111-1111-1111-111111111111"], "checkpoint": []}

    monkeypatch.setattr("leases.reconcile.reconcile_heartbeat", reconcile)
    api = node_api(secret)
    post_beat(api, node, incarnation=1, sequence=10)
    lease = {"lease_id": "22222222-2222-2222-2222-222222222222", "fencing_token": 3, "state": "running"}
    response = post_beat(api, node, incarnation=2, sequence=0, leases=[lease])
    assert response.json()["applied"] is True
    assert response.json()["instructions"]["stop_leases"] == ["11111111-1111-1111-1111-111111111111"]
    node.refresh_from_db()
    assert node.restart_count == 1 and node.incarnation == 2
    restart = events(node, fleet_events.RESTART)
    assert len(restart) == 1 and (restart[0].from_state, restart[0].to_state) == ("1", "2")
    assert calls == [(1, [], False), (2, [lease], True)]


def test_maintenance_rules_see_every_applied_heartbeat(node_secret, monkeypatch):
    node, secret = node_secret
    seen = []
    monkeypatch.setattr(
        "maintenance.rules.evaluate_heartbeat",
        lambda node, *, usage, agent_version, actor: seen.append((usage, agent_version)),
    )
    api = node_api(secret)
    post_beat(api, node, sequence=1)
    post_beat(api, node, sequence=1)  # a duplicate is not applied, so not evaluated
    assert seen == [({"cpu": 1200, "memory": 4 * 2**30}, "1.0.0")]


def test_the_server_stamps_its_own_receipt_time_not_the_node_clock(node_secret):
    node, secret = node_secret
    response = post_beat(node_api(secret), node, observed_at=T0 - timedelta(days=3))
    assert response.json()["server_time"].startswith("2026-11-29T09:00:00")
    node.refresh_from_db()
    assert node.last_heartbeat_at == T0
    assert node.clock_skew_seconds == -3 * 86400


@pytest.mark.parametrize(("offset", "reason"), [(120, "NodeClockAhead"), (-120, "NodeClockBehind")])
def test_node_clock_beyond_the_threshold_sets_clock_skew_and_records_an_event(node_secret, offset, reason):
    node, secret = node_secret
    post_beat(node_api(secret), node, observed_at=T0 + seconds(offset))
    node.refresh_from_db()
    skew = next(c for c in node.conditions if c["type"] == "ClockSkew")
    assert (skew["status"], skew["reason"]) == ("True", reason)
    assert node.health == Health.DEGRADED  # ClockSkew degrades by default; degraded stays schedulable
    assert [e.to_state for e in events(node, fleet_events.CLOCK_SKEW)] == ["True"]


def test_clock_skew_clears_once_the_clock_is_back_in_step(node_secret):
    node, secret = node_secret
    api = node_api(secret)
    post_beat(api, node, sequence=1, observed_at=T0 + seconds(60))
    post_beat(api, node, sequence=2, observed_at=T0 + seconds(27))  # within hysteresis: still skewed
    post_beat(api, node, sequence=3, observed_at=T0 + seconds(1))
    node.refresh_from_db()
    assert next(c for c in node.conditions if c["type"] == "ClockSkew")["status"] == "False"
    assert node.health == Health.HEALTHY
    assert [e.to_state for e in reversed(events(node, fleet_events.CLOCK_SKEW))] == ["True", "False"]


def test_small_skew_adds_no_condition(node_secret):
    node, secret = node_secret
    post_beat(node_api(secret), node, observed_at=T0 - seconds(5))
    node.refresh_from_db()
    assert all(c["type"] != "ClockSkew" for c in node.conditions)
    assert not events(node, fleet_events.CLOCK_SKEW)


def test_a_node_clock_in_the_future_never_makes_a_node_look_alive_longer(node_secret, time_machine):
    node, secret = node_secret
    post_beat(node_api(secret), node, observed_at=T0 + timedelta(hours=1))
    time_machine.shift(21)
    sweep_liveness()
    node.refresh_from_db()
    assert node.liveness == Liveness.STALE


def test_a_node_clock_in_the_past_never_makes_a_fresh_heartbeat_look_stale(node_secret, time_machine):
    node, secret = node_secret
    post_beat(node_api(secret), node, observed_at=T0 - timedelta(hours=1))
    time_machine.shift(5)
    sweep_liveness()
    node.refresh_from_db()
    assert node.liveness == Liveness.ALIVE


def test_a_stale_node_comes_back_alive_with_one_heartbeat(node_secret, time_machine):
    node, secret = node_secret
    api = node_api(secret)
    post_beat(api, node, sequence=1)
    time_machine.shift(21)
    sweep_liveness()
    time_machine.shift(1)
    assert post_beat(api, node, sequence=2).json()["liveness"] == "alive"
    node.refresh_from_db()
    assert node.liveness == Liveness.ALIVE and node.liveness_changed_at == T0 + seconds(22)
    assert [(e.from_state, e.to_state) for e in events(node, fleet_events.LIVENESS)][0] == ("stale", "alive")


def test_condition_change_appends_an_event_and_an_unchanged_heartbeat_appends_none(node_secret, time_machine):
    node, secret = node_secret
    api = node_api(secret)
    post_beat(api, node, sequence=1)
    first = NodeEvent.objects.filter(node=node).count()
    time_machine.shift(10)
    post_beat(api, node, sequence=2, usage={"cpu": 3000})
    assert NodeEvent.objects.filter(node=node).count() == first
    pressure = [
        {"type": "Ready", "status": "True", "reason": "AgentReady", "message": ""},
        {"type": "MemoryPressure", "status": "True", "reason": "LowMemory", "message": "92% used"},
        {"type": "DiskPressure", "status": "False", "reason": "", "message": ""},
    ]
    post_beat(api, node, sequence=3, conditions=pressure)
    node.refresh_from_db()
    condition = events(node, fleet_events.CONDITION)[0]
    assert (condition.reason, condition.to_state) == ("MemoryPressure: False → True", "True")
    assert node.health == Health.UNHEALTHY and node.health_reasons == ["MemoryPressure=True (LowMemory)"]
    assert [(e.from_state, e.to_state) for e in events(node, fleet_events.HEALTH)][0] == ("healthy", "unhealthy")
    memory = next(c for c in node.conditions if c["type"] == "MemoryPressure")
    assert memory["last_transition_time"] == (T0 + seconds(10)).isoformat()


def test_readiness_change_appends_an_event(node_secret):
    node, secret = node_secret
    api = node_api(secret)
    post_beat(api, node, sequence=1)
    post_beat(api, node, sequence=2, ready=False, ready_reason="draining local disk")
    node.refresh_from_db()
    assert node.ready is False and node.ready_reason == "draining local disk"
    event = events(node, fleet_events.READINESS)[0]
    assert (event.from_state, event.to_state, event.reason) == ("true", "false", "draining local disk")


def test_ready_condition_false_is_unhealthy_under_any_policy():
    pool = PoolFactory(unhealthy_conditions=["GPUXid"])
    node, secret = make_schedulable_node(pool)
    post_beat(node_api(secret), node, conditions=[{"type": "Ready", "status": "False", "reason": "KubeletDown"}])
    node.refresh_from_db()
    assert node.health == Health.UNHEALTHY


def test_heartbeats_never_change_the_lifecycle(node_secret, time_machine):
    node, secret = node_secret
    set_lifecycle(node, Lifecycle.DRAINING)
    api = node_api(secret)
    body = post_beat(api, node, sequence=1).json()
    assert (body["lifecycle"], body["desired_lifecycle"]) == ("draining", "maintenance")
    time_machine.shift(600)
    sweep_liveness()
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.DRAINING and node.liveness == Liveness.LOST


def test_a_retired_node_gets_410_and_nothing_is_recreated(node_secret):
    node, secret = node_secret
    set_lifecycle(node, Lifecycle.RETIRED)
    response = post_beat(node_api(secret), node, sequence=1)
    assert response.status_code == 410 and response.json()["code"] == "node_retired"
    assert Node.objects.filter(pk=node.pk).values_list("sequence", "liveness").get() == (-1, Liveness.ALIVE)
    assert Node.objects.count() == 1


def test_another_nodes_credential_is_forbidden(node_secret):
    node, _ = node_secret
    _, other_secret = make_schedulable_node(node.pool)
    response = post_beat(node_api(other_secret), node)
    assert response.status_code == 403


def test_no_credential_or_a_user_token_cannot_send_heartbeats(node_secret, anon_api, operator_api):
    node, _ = node_secret
    assert anon_api.post(f"/api/v1/nodes/{node.pk}/heartbeats", beat(), format="json").status_code == 401
    as_user = operator_api.post(f"/api/v1/nodes/{node.pk}/heartbeats", beat(), format="json")
    assert (as_user.status_code, as_user.json()["code"]) == (403, "forbidden")  # a user, but not this node
    assert Node.objects.get(pk=node.pk).sequence == node.sequence, "no heartbeat was applied"


def test_a_revoked_credential_is_refused_with_401(node_secret):
    from fleet.credentials import revoke_all_credentials

    node, secret = node_secret
    revoke_all_credentials(node=node)
    response = post_beat(node_api(secret), node)
    assert response.status_code == 401 and response.json()["code"] == "authentication_failed"


def test_a_body_over_the_size_limit_is_413_and_nothing_is_applied(node_secret):
    node, secret = node_secret
    from fleet.heartbeats import MAX_BODY_BYTES

    body = beat(sequence=1, ready_reason="x" * (MAX_BODY_BYTES + 1000))
    response = node_api(secret).post(f"/api/v1/nodes/{node.pk}/heartbeats", body, format="json")
    assert response.status_code == 413 and response.json()["code"] == "payload_too_large"
    node.refresh_from_db()
    assert node.sequence == -1


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"conditions": [{"type": f"Gpu{i}Ready", "status": "True"} for i in range(33)]}, "conditions"),
        (
            {
                "leases": [
                    {"lease_id": f"00000000-0000-0000-0000-{i:012d}", "fencing_token": 1, "state": "running"}
                    for i in range(257)
                ]
            },  # fmt: skip
            "leases",
        ),
        ({"agent_version": "1" * 65}, "agent_version"),
        ({"ready_reason": "r" * 201}, "ready_reason"),
        ({"conditions": [{"type": "Ready", "status": "True", "message": "m" * 1025}]}, "conditions[0].message"),
        ({"usage": {f"example.com/r{i}": 1 for i in range(33)}}, "usage"),
    ],
)
def test_beyond_a_documented_limit_is_422_and_nothing_is_applied(node_secret, fields, field):
    node, secret = node_secret
    response = post_beat(node_api(secret), node, sequence=1, **fields)
    assert response.status_code == 422
    assert response.json()["code"] == "heartbeat_limit_exceeded"
    assert field in [e["field"] for e in response.json()["errors"]]
    node.refresh_from_db()
    assert node.sequence == -1


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"incarnation": None}, "incarnation"),
        ({"incarnation": 0}, "incarnation"),
        ({"sequence": "7"}, "sequence"),
        ({"sequence": -1}, "sequence"),
        ({"sequence": True}, "sequence"),
        ({"observed_at": "yesterday"}, "observed_at"),
        ({"ready": "yes"}, "ready"),
        ({"conditions": [{"type": "Ready", "status": "Maybe"}]}, "conditions[0].status"),
        (
            {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Ready", "status": "False"}]},
            "conditions[1].type",
        ),
        ({"conditions": "Ready"}, "conditions"),
        ({"leases": [{"lease_id": "nope", "fencing_token": 1, "state": "running"}]}, "leases[0].lease_id"),
        (
            {"leases": [{"lease_id": "00000000-0000-0000-0000-000000000001", "fencing_token": -2, "state": "running"}]},
            "leases[0].fencing_token",
        ),  # fmt: skip
        ({"usage": {"cpu": "lots"}}, "usage.cpu"),
        ({"usage": {"cpu": -5}}, "usage.cpu"),
    ],
)
def test_malformed_heartbeat_fields_are_400_and_nothing_is_applied(node_secret, fields, field):
    node, secret = node_secret
    body = {**beat(sequence=1), **fields}
    if fields.get("incarnation", 1) is None:
        del body["incarnation"]
    response = node_api(secret).post(f"/api/v1/nodes/{node.pk}/heartbeats", body, format="json")
    assert response.status_code == 400, response.json()
    quantity = isinstance(fields.get("usage", {}).get("cpu"), str)  # a string the quantity parser refused
    assert response.json()["code"] == ("invalid_quantity" if quantity else "validation_error")
    assert field in [e["field"] for e in response.json()["errors"]]
    node.refresh_from_db()
    assert node.sequence == -1


def test_a_body_that_is_not_json_is_400(node_secret):
    node, secret = node_secret
    response = node_api(secret).post(
        f"/api/v1/nodes/{node.pk}/heartbeats", "{not json", content_type="application/json"
    )
    assert response.status_code == 400 and response.json()["code"] == "malformed_body"


def test_usage_accepts_quantity_strings(node_secret):
    node, secret = node_secret
    post_beat(node_api(secret), node, usage={"cpu": "1500m", "memory": "2Gi"})
    node.refresh_from_db()
    assert node.usage == {"cpu": 1500, "memory": 2 * 2**30}


def statements(captured):
    return [q["sql"] for q in captured.captured_queries if "SAVEPOINT" not in q["sql"]]


def test_an_accepted_heartbeat_uses_a_small_fixed_number_of_queries(node_secret, time_machine):
    node, secret = node_secret
    api = node_api(secret)
    post_beat(api, node, sequence=1)  # warm the fleet-size cache
    # An unchanged heartbeat: the credential lookup (with node and pool), the conditional UPDATE,
    # the node's live leases (reconciliation), its capacity (the impossible-usage rule) and the
    # UPDATE extending its availability interval (marketplace.availability).
    for sequence in (2, 3):
        time_machine.shift(10)
        with CaptureQueriesContext(connection) as unchanged:
            assert post_beat(api, node, sequence=sequence).json()["applied"] is True
        sql = statements(unchanged)
        assert len(sql) == 5, "\n".join(s[:150] for s in sql)
        assert "leases_lease" in sql[2] and "fleet_noderesource" in sql[3]
        assert "marketplace_nodeavailability" in sql[4]
    # ...plus one INSERT for all the events, however many there are.
    with CaptureQueriesContext(connection) as changed:
        post_beat(api, node, sequence=4, ready=False, observed_at=T0 + timedelta(hours=1))
    assert len(statements(changed)) == 6
    assert NodeEvent.objects.filter(node=node, created_at=T0 + seconds(20)).count() == 3  # ready, skew, health
    # A node being admitted also looks up a requested benchmark (and is exempt from the usage rule);
    # it offers nothing, so its availability interval is closed instead of extended.
    set_lifecycle(node, Lifecycle.ADMITTING)
    with CaptureQueriesContext(connection) as admitting:
        post_beat(api, node, sequence=5, ready=False, observed_at=T0 + timedelta(hours=1))
    assert len(statements(admitting)) == 6


def test_a_requested_benchmark_is_in_the_instructions(node_secret):
    node, secret = node_secret
    set_lifecycle(node, Lifecycle.ADMITTING)
    Benchmark.objects.create(node=node, nonce="n-1", requested_at=T0, deadline=T0 + seconds(300))
    body = post_beat(node_api(secret), node).json()
    assert body["instructions"]["run_benchmark"]["nonce"] == "n-1"
    assert body["instructions"]["run_benchmark"]["deadline"].startswith("2026-11-29T09:05:00")


def test_the_response_hints_to_rotate_a_credential_near_its_expiry(node_secret, time_machine):
    node, _ = node_secret
    _, secret = issue_credential(node=node, issuer="test", ttl_seconds=1000)
    api = node_api(secret)
    assert post_beat(api, node, sequence=1).json()["instructions"]["rotate_credential"] is False
    time_machine.shift(760)
    assert post_beat(api, node, sequence=2).json()["instructions"]["rotate_credential"] is True


def test_the_interval_grows_with_the_fleet_to_stay_under_the_heartbeat_ceiling(settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "MAX_HEARTBEATS_PER_SECOND": 1.0}
    pool = PoolFactory()
    nodes = [make_schedulable_node(pool) for _ in range(30)]
    node, secret = nodes[0]
    body = post_beat(node_api(secret), node).json()
    assert body["renewal_interval"] == 30  # 30 nodes at 1/s; never below the pool's 10 s
    assert 0.6 * 30 <= body["next_heartbeat_in"] <= 1.4 * 30  # aimed at the node's slot
    node.refresh_from_db()
    assert node.next_liveness_check_at == T0 + seconds(60)


def test_next_heartbeat_in_aims_at_the_nodes_slot_within_0_6_and_1_4_intervals(node_secret, time_machine):
    node, secret = node_secret
    api = node_api(secret)
    values = []
    for i in range(20):
        time_machine.move_to(T0 + seconds(i * 1.7), tick=False)
        values.append(post_beat(api, node, sequence=i).json()["next_heartbeat_in"])
    assert min(values) >= 6 and max(values) <= 14


def test_the_heartbeat_credential_lookup_loads_what_the_orm_loads(node_secret):
    from fleet.api.heartbeat_views import HeartbeatAuthentication
    from fleet.models import NodeCredential

    node, secret = node_secret
    node.refresh_from_db()
    prefix = secret.split("_", 1)[1].split(".", 1)[0]
    fast = HeartbeatAuthentication().find_credential(prefix)
    slow = NodeCredential.objects.select_related("node", "node__pool").get(prefix=prefix)
    for name in ("id", "secret_hash", "issued_at", "expires_at", "revoked_at"):
        assert getattr(fast, name) == getattr(slow, name)
    for name in ("lifecycle", "liveness", "last_heartbeat_at", "conditions", "usage", "incarnation", "sequence"):
        assert getattr(fast.node, name) == getattr(slow.node, name)
    assert fast.node.pool.heartbeat_grace == 40 and fast.node.pool.name == "general"
    assert fast.node.declared == slow.node.declared  # a deferred field, loaded on access
    assert HeartbeatAuthentication().find_credential("000000000000") is None


def test_an_unknown_or_expired_credential_is_refused_with_401(node_secret, time_machine):
    node, secret = node_secret
    assert post_beat(node_api(secret[:-4] + "abcd"), node).status_code == 401
    assert post_beat(node_api("npn_nonsense"), node).status_code == 401
    time_machine.shift(2 * 86400)
    assert post_beat(node_api(secret), node).json()["code"] == "authentication_failed"
