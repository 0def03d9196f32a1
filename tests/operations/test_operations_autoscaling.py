"""Autoscaling through a provider: scale-up for pending demand a template node would fit (bounded by
max_nodes, the rate and cool-downs, every decision with its reason), a webhook provider that signs
its requests and carries a fresh single-use bootstrap token per machine, failures that leave
nothing half-done, and scale-down of idle machines within disruption budgets and min_nodes."""

from __future__ import annotations

import contextlib
import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.cache import cache
from django.utils import timezone

from fleet.events import Actor
from fleet.models import BootstrapToken, NodeEvent
from leases.models import LeaseRequest
from maintenance.models import DisruptionBudget
from operations import autoscaler, demand, launches, machines, providers
from operations.models import PoolOperations, Preemption, ProviderMachine, ScaleDecision
from tests.egress_support import allow_loopback
from tests.factories import PoolFactory, make_schedulable_node, set_lifecycle
from tests.maintenance_support import make_lease
from tests.processes import free_port
from tests.races import race

pytestmark = pytest.mark.django_db
ACTOR = Actor.system("system:autoscaler")
TEMPLATE = {"resources": {"cpu": "4", "memory": "8Gi"}, "labels": {"zone": "zone-a"}}


@pytest.fixture(autouse=True)
def _fresh_cache():
    cache.clear()


@pytest.fixture(autouse=True)
def _loopback_receivers_allowed(settings):
    """The receivers here listen on 127.0.0.1: allowed as an operator allows a provider inside
    their network (NODEPOOL_EGRESS_ALLOW; nodepool.egress refuses loopback otherwise)."""
    allow_loopback(settings)


class Receiver:
    """An operator's webhook endpoint on loopback: verifies each request like a real receiver would."""

    def __init__(self, secret: str, status: int = 200):
        self.secret, self.status, self.requests, self.refusals = secret, status, [], []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    data = providers.verify(receiver.secret, self.headers, body, remember=False)
                except providers.SignatureError as exc:
                    receiver.refusals.append(exc.code)
                    self.send_response(401)
                    self.end_headers()
                    return
                receiver.requests.append(data)
                self.send_response(receiver.status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                names = {m["name"]: {"instance": f"i-{n}"} for n, m in enumerate(data["machines"])}
                self.wfile.write(json.dumps({"machines": names}).encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/scale"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver("hook-secret")
    yield r
    r.close()


def configure(api, pool, **fields):
    ops = PoolOperations.objects.get_or_create(pool=pool)[0]
    body = {"node_template": TEMPLATE, "min_nodes": 1, "max_nodes": 3, "scale_up_delay": 0, "scale_up_cooldown": 0,
            "max_nodes_per_scale_up": 5, **fields}  # fmt: skip
    response = api.patch(f"/api/v1/pools/{pool.name}/operations", body, format="json",
                         HTTP_IF_MATCH=f'"{ops.version}"')  # fmt: skip
    assert response.status_code == 200, response.content
    return response.json()


def occupy(api, cpu="3"):
    """Ask for a lease named ``busy`` (``cpu`` cores): what the pool's nodes already run."""
    body = {"workload_id": "busy", "pool": "general", "resources": {"cpu": cpu}}
    api.post("/api/v1/node-leases", body, format="json")


def queue(api, workload_id, cpu="3"):
    body = {"workload_id": workload_id, "pool": "general", "resources": {"cpu": cpu}, "queue": True}
    response = api.post("/api/v1/node-leases", body, format="json")
    assert response.status_code == 202, response.content
    return response.json()


def test_pending_demand_scales_up_through_a_signed_webhook_with_fresh_single_use_tokens(
    operator_api, client_api, receiver
):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret")
    occupy(client_api)
    queue(client_api, "job-1")
    queue(client_api, "job-2")

    assert demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=timezone.now()) == 2

    assert receiver.refusals == []
    (request,) = receiver.requests
    assert (request["action"], request["pool"], len(request["machines"])) == ("create", "general", 2)
    # The template in the operator's units, as written (not millicores and bytes).
    assert request["machines"][0]["template"]["resources"] == {"cpu": "4", "memory": "8Gi"}
    secrets = [m["bootstrap_token"] for m in request["machines"]]
    assert len(set(secrets)) == 2 and all(s.startswith("npb_") for s in secrets)
    machines = ProviderMachine.objects.filter(pool=pool)
    assert {m.state for m in machines} == {"requested"}
    assert {m.provider_data["instance"] for m in machines} == {"i-0", "i-1"}
    assert all(m.bootstrap_token.max_uses == 1 for m in machines)
    decision = ScaleDecision.objects.get(outcome="succeeded")
    assert decision.direction == "up" and decision.count == 2
    assert "2 lease request(s) pending" in decision.reason
    assert NodeEvent.objects.filter(type="scale", pool=pool).exists()


def test_a_preemption_notice_asks_for_replacement_capacity_at_once(
    operator_api, receiver, django_capture_on_commit_callbacks
):
    pool = PoolFactory(name="spot")
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              spot=True, min_nodes=0, max_nodes=1)  # fmt: skip
    deadline = (timezone.now() + timedelta(seconds=120)).isoformat()
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_api.post("/api/v1/pools/spot/preemption-notices",
                                     {"node_id": str(node.pk), "deadline": deadline}, format="json")  # fmt: skip
    assert response.status_code == 201, response.content
    # At max_nodes 1, but the preempted node is leaving: its replacement is asked before any work
    # comes back as pending requests.
    (request,) = receiver.requests
    assert (request["action"], len(request["machines"])) == ("create", 1)
    decision = ScaleDecision.objects.get(data__preemption_id=response.json()["id"])
    assert decision.outcome == "succeeded" and "replacement for a preempted node" in decision.reason
    # The drain ends a margin before the notice: 10 % of 120 s is 12 s (more than the 10 s minimum).
    drain = node.drains.get()
    assert abs((Preemption.objects.get().deadline - drain.deadline).total_seconds() - 12) < 1


def test_a_replacement_is_not_asked_of_pools_without_autoscaling_and_says_why(
    operator_api, django_capture_on_commit_callbacks
):
    # The spot pool has no provider; its fallback has no operations settings at all (never
    # configured: no autoscaling). Neither can replace the node: nothing is asked, no traceback,
    # and the preempted pool says why, once.
    pool = PoolFactory(name="spot")
    fallback = PoolFactory(name="ondemand")
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    configure(operator_api, pool, spot=True, fallback_pool="ondemand")
    assert not PoolOperations.objects.filter(pool=fallback).exists()
    deadline = (timezone.now() + timedelta(seconds=120)).isoformat()
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_api.post("/api/v1/pools/spot/preemption-notices",
                                     {"node_id": str(node.pk), "deadline": deadline}, format="json")  # fmt: skip
    assert response.status_code == 201, response.content
    preemption_id = response.json()["id"]
    decision = ScaleDecision.objects.get(data__preemption_id=preemption_id)
    assert (decision.pool, decision.outcome, decision.count) == (pool, "blocked", 0)
    assert "pool spot: no autoscaling" in decision.reason
    assert "fallback pool ondemand: no autoscaling" in decision.reason
    assert not ProviderMachine.objects.exists()
    assert not PoolOperations.objects.filter(pool=fallback).exists()  # not created as a side effect
    # Once per preemption: asked again (a retried task), nothing more is recorded.
    assert launches.request_replacement(pool_id=pool.pk, preemption_id=preemption_id, node_id=str(node.pk),
                                          actor=ACTOR) == 0  # fmt: skip
    assert ScaleDecision.objects.filter(data__preemption_id=preemption_id).count() == 1


def test_a_replacement_for_a_pool_at_max_nodes_skips_a_fallback_without_autoscaling(
    operator_api, receiver, django_capture_on_commit_callbacks
):
    pool = PoolFactory(name="spot")
    PoolFactory(name="ondemand")
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              spot=True, fallback_pool="ondemand", min_nodes=0, max_nodes=1)  # fmt: skip
    deadline = (timezone.now() + timedelta(seconds=120)).isoformat()
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_api.post("/api/v1/pools/spot/preemption-notices",
                                     {"node_id": str(node.pk), "deadline": deadline}, format="json")  # fmt: skip
    assert response.status_code == 201, response.content
    assert receiver.requests == []
    (decision,) = ScaleDecision.objects.filter(data__preemption_id=response.json()["id"])
    assert (decision.pool, decision.outcome) == (pool, "blocked")
    assert "at max_nodes 1" in decision.reason


def test_scale_up_is_bounded_by_max_nodes_and_the_cool_down_and_says_why(operator_api, client_api, receiver):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              max_nodes=2, scale_up_cooldown=600)  # fmt: skip
    occupy(client_api)
    for n in range(3):
        queue(client_api, f"job-{n}")

    assert demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=timezone.now()) == 1  # max_nodes 2 - 1 node
    assert demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=timezone.now()) == 0
    assert demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=timezone.now()) == 0
    held = ScaleDecision.objects.filter(outcome="blocked")
    assert held.count() == 1, "a repeated held-back decision is recorded once"
    assert "at max_nodes 2" in held.get().reason
    assert ProviderMachine.objects.count() == 1


def test_a_request_no_template_node_could_hold_does_not_scale_up(operator_api, client_api, receiver):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 16000, "memory": 2**35})
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret")
    occupy(client_api, cpu="16")
    queue(client_api, "huge", cpu="8")  # the template has 4 CPUs
    assert demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=timezone.now()) == 0
    assert not ProviderMachine.objects.exists()


def test_a_failing_provider_is_retried_a_bounded_number_of_times_and_leaves_nothing_half_done(
    operator_api, client_api, settings
):
    settings.NODEPOOL = {**settings.NODEPOOL, "PROVIDER_MAX_ATTEMPTS": 2}
    failing = Receiver("hook-secret", status=503)
    try:
        pool = PoolFactory(name="general")
        make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
        configure(operator_api, pool, provider="webhook", provider_url=failing.url, provider_secret="hook-secret")
        occupy(client_api)
        queue(client_api, "job-1")
        demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=timezone.now())
    finally:
        failing.close()
    creates = [r for r in failing.requests if r["action"] == "create"]
    assert len(creates) == 2
    decision = ScaleDecision.objects.get(direction="up")
    assert (decision.outcome, decision.attempts) == ("failed", 2)
    assert "HTTP 503 Service Unavailable" in decision.error
    assert "machines" not in decision.error  # the receiver's body is never reflected
    machine = ProviderMachine.objects.get()
    assert machine.state == "failed"
    assert BootstrapToken.objects.get(pk=machine.bootstrap_token_id).revoked_at is not None
    assert any(r["action"] == "delete" for r in failing.requests)


def test_a_machine_that_enrolled_before_its_providers_create_failed_is_failed_and_its_node_retired(
    operator_api, client_api, receiver, settings, monkeypatch
):
    """The provider started the machine, which enrolled and was linked by a pass (``enrolled``),
    then the create failed (a timeout, say). The create's failure deletes what it asked for at
    the provider, so the machine is gone: it is failed, as a requested machine is, its node
    retired, and the provider asked to delete it once — not left ``enrolled`` holding a place
    under ``max_nodes`` until its boot timeout, its node enrolled for nothing."""
    settings.NODEPOOL = {**settings.NODEPOOL, "PROVIDER_MAX_ATTEMPTS": 1}
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret")
    occupy(client_api)
    queue(client_api, "job-1")
    enrolled, deleted = [], []

    class Provider:
        def create(self, requests):
            for request in requests:  # started, enrolled with its token, linked by a pass
                machine = ProviderMachine.objects.get(name=request.name)
                node = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})[0]
                node.bootstrap_token_id = machine.bootstrap_token_id
                node.save(update_fields=["bootstrap_token"])
                set_lifecycle(node, "pending")
                ops = PoolOperations.objects.get(pool=pool)
                machines._follow(machine, ops, ACTOR, timezone.now())
                enrolled.append((ProviderMachine.objects.get(pk=machine.pk).state, node))
            raise providers.ProviderError("timed out waiting for the provider")

        def delete(self, name, data):
            deleted.append(name)

    monkeypatch.setattr(providers, "provider_for", lambda ops: Provider())
    demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=timezone.now())
    ((state, node),) = enrolled
    assert state == "enrolled"
    machine = ProviderMachine.objects.get()
    assert machine.state == "failed" and "timed out waiting for the provider" in machine.error
    assert node.reload().lifecycle == "retired"
    assert deleted == [machine.name]
    assert ScaleDecision.objects.get(direction="up").outcome == "failed"
    assert NodeEvent.objects.filter(subject_type="machine", subject_id=machine.pk, to_state="failed").count() == 1


def idle_machines(api, receiver, **settings):
    """Pool ``general`` on the webhook provider with two ready, idle machines m-0 (older) and m-1."""
    pool = PoolFactory(name="general")
    configure(api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              scale_down_cooldown=0, drain_policy="terminate", **settings)  # fmt: skip
    for n in range(2):
        node = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})[0]
        ProviderMachine.objects.create(pool=pool, provider="webhook", name=f"m-{n}", node=node, state="ready",
                                       requested_at=timezone.now() - timedelta(minutes=5 - n))  # fmt: skip
    return pool


def test_an_idle_machine_is_drained_and_deleted_but_never_below_min_nodes(operator_api, receiver):
    pool = idle_machines(operator_api, receiver, min_nodes=1, scale_down_after=60)
    now = timezone.now()
    assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now) == 0  # underused from now on
    assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(seconds=30)) == 0
    assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(seconds=61)) == 1
    machines.follow_machines(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(seconds=62))
    assert ProviderMachine.objects.filter(state="deleted").count() == 1
    assert [r["action"] for r in receiver.requests] == ["delete"]
    assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(seconds=200)) == 0
    assert "at min_nodes 1" in ScaleDecision.objects.filter(outcome="blocked").latest("created_at").reason
    retired = ProviderMachine.objects.get(state="deleted").node
    assert retired.lifecycle == "retired"


def test_a_disruption_budget_keeps_an_idle_machine_in_place(operator_api, receiver):
    pool = PoolFactory(name="general")
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              min_nodes=0, scale_down_after=0, scale_down_cooldown=0, scale_down_utilization=0.5)  # fmt: skip
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    ProviderMachine.objects.create(pool=pool, provider="webhook", name="m-0", node=node, state="ready",
                                   requested_at=timezone.now())  # fmt: skip
    make_lease(node, "db-1", group="db", resources={"cpu": 500})
    DisruptionBudget.objects.create(group="db", max_unavailable=0)
    now = timezone.now()
    autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now)
    assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(seconds=1)) == 0
    node.refresh_from_db()
    assert node.lifecycle == "ready"
    assert "disruption budget" in ScaleDecision.objects.get(outcome="blocked").reason


def test_signatures_reject_tampering_stale_timestamps_and_replays():
    body = json.dumps({"delivery_id": "abc", "action": "create"}).encode()
    headers = providers.signed_headers("k", body, "abc")
    assert providers.verify("k", headers, body)["action"] == "create"
    with pytest.raises(providers.SignatureError) as replay:
        providers.verify("k", headers, body)
    assert replay.value.code == "replayed"
    with pytest.raises(providers.SignatureError) as tampered:
        providers.verify("k", headers, body.replace(b"create", b"delete"), remember=False)
    assert tampered.value.code == "signature_invalid"
    old = providers.signed_headers("k", body, "abc", now=1_000_000)
    with pytest.raises(providers.SignatureError) as stale:
        providers.verify("k", old, body, remember=False)
    assert stale.value.code == "signature_expired"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"provider": "carrier-pigeon"}, "invalid_pool_operations"),
        ({"min_nodes": -1}, "invalid_pool_operations"),
        ({"min_nodes": 5, "max_nodes": 2}, "invalid_pool_operations"),
        ({"scale_down_utilization": 2}, "invalid_pool_operations"),
        ({"provider_url": "ftp://x"}, "invalid_pool_operations"),
        ({"fallback_pool": "general"}, "unknown_pool"),
        ({"node_template": {"resources": {"cpu": "lots"}}}, "invalid_pool_operations"),
        ({"target": {"version": "9"}}, "invalid_pool_operations"),
    ],
)
def test_bad_pool_operation_settings_are_refused_and_change_nothing(operator_api, body, code):
    pool = PoolFactory(name="general")
    response = operator_api.patch("/api/v1/pools/general/operations", body, format="json", HTTP_IF_MATCH='"1"')
    assert (response.status_code, response.json()["code"]) == (400, code)
    ops = PoolOperations.objects.filter(pool=pool).first()
    assert ops is None or (ops.version, ops.provider, ops.min_nodes) == (1, "", 0)


def test_pool_operation_settings_need_the_current_version(operator_api):
    PoolFactory(name="general")
    assert operator_api.patch("/api/v1/pools/general/operations", {"spot": True}, format="json").status_code == 428
    stale = operator_api.patch("/api/v1/pools/general/operations", {"spot": True}, format="json",
                               HTTP_IF_MATCH='"7"')  # fmt: skip
    assert stale.status_code == 412
    assert LeaseRequest.objects.count() == 0


def test_an_upgrade_with_surge_asks_the_provider_first_once_and_ready_surge_nodes_add_room(
    operator_api, receiver, django_capture_on_commit_callbacks
):
    from operations import rollout, upgrades

    pool = PoolFactory(name="general")
    for _ in range(3):
        make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              max_nodes=5)  # fmt: skip
    upgrade = upgrades.upgrade_create(
        data={"pool": "general", "target": {"version": "2.0.0"}, "canary_nodes": 0, "max_surge_nodes": 1}, actor=ACTOR
    )
    with django_capture_on_commit_callbacks(execute=True):
        upgrades.upgrade_start(upgrade_id=upgrade.pk, expected_version=upgrade.version, actor=ACTOR)
    with django_capture_on_commit_callbacks(execute=True):
        rollout.advance(upgrade_id=upgrade.pk)
        rollout.advance(upgrade_id=upgrade.pk)
    surge = ScaleDecision.objects.get(data__upgrade_id=str(upgrade.pk))
    assert (surge.direction, surge.count, surge.outcome) == ("up", 1, "succeeded")
    assert "upgrade surge" in surge.reason
    assert [r["action"] for r in receiver.requests] == ["create"]
    machine = ProviderMachine.objects.get(decision=surge)
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    ProviderMachine.objects.filter(pk=machine.pk).update(node=node, state="ready", ready_at=timezone.now())
    assert launches.surge_ready(pool_id=pool.pk, upgrade_id=upgrade.pk) == 1


def test_no_machine_is_scaled_down_while_lease_requests_wait_that_a_template_node_would_hold(
    operator_api, client_api, receiver
):
    """Idle is not unneeded while demand waits (cluster-autoscaler keeps nodes pending pods could
    use): otherwise a just-ready machine is drained before the queue places work on it."""
    from leases.models import LeaseRequest

    pool = PoolFactory(name="general")
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              min_nodes=0, max_nodes=1, scale_down_after=0, scale_down_cooldown=0,
              scale_down_utilization=0.6, drain_policy="terminate")  # fmt: skip
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    make_lease(node, "small", resources={"cpu": 2000})  # 50 %: underused
    ProviderMachine.objects.create(pool=pool, provider="webhook", name="m-0", node=node, state="ready",
                                   requested_at=timezone.now() - timedelta(minutes=5))  # fmt: skip
    waiting = queue(client_api, "batch-1", cpu="3")  # waits: 2 cpu free here, a template node holds it
    now = timezone.now()
    autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now)
    assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(seconds=1)) == 0
    assert "1 lease request(s) pending" in ScaleDecision.objects.filter(outcome="blocked").latest("created_at").reason
    LeaseRequest.objects.filter(pk=waiting["id"]).update(state="cancelled")
    autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(seconds=2))
    latest = ScaleDecision.objects.filter(pool=pool).latest("created_at")
    assert "lease request(s) pending" not in latest.reason  # judged on its own merits again (its lease)


def test_a_node_changed_under_scale_down_is_skipped_and_the_next_idle_one_goes(operator_api, receiver, monkeypatch):
    """An operator's hold lands between the pass's read of a node and its cordon (412 from the
    node's version): the pass names it and moves on, instead of failing (a traceback in the worker)."""
    from maintenance import holds

    pool = idle_machines(operator_api, receiver, min_nodes=0, scale_down_after=0)
    real, held = autoscaler.replaceable, []

    def an_operator_holds_the_first_node_meanwhile(node):
        if not held:
            held.append(holds.place_hold(node.pk, "user:operator", "looking at it"))
        return real(node)

    monkeypatch.setattr(autoscaler, "replaceable", an_operator_holds_the_first_node_meanwhile)
    assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=timezone.now()) == 1  # scale_down_after=0
    assert ProviderMachine.objects.get(name="m-0").state == "ready"
    assert ProviderMachine.objects.get(name="m-1").state == "draining"
    decision = ScaleDecision.objects.get(direction="down", outcome="requested")
    assert decision.data["machine"] == "m-1"


def test_a_machine_moved_on_under_scale_down_is_left_alone(operator_api, receiver, monkeypatch):
    """A following pass (no pool lock) marks a machine failed between scale-down's read and its
    move: scale-down neither drains the node nor overwrites the machine's state, and takes the next."""
    pool = idle_machines(operator_api, receiver, min_nodes=0, scale_down_after=0)
    real, moved = autoscaler.replaceable, []

    def the_first_machine_fails_meanwhile(node):
        if not moved:
            moved.append(ProviderMachine.objects.filter(node=node).update(state="failed"))
        return real(node)

    monkeypatch.setattr(autoscaler, "replaceable", the_first_machine_fails_meanwhile)
    assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=timezone.now()) == 1
    first, second = ProviderMachine.objects.get(name="m-0"), ProviderMachine.objects.get(name="m-1")
    assert first.state == "failed"
    assert not first.node.reload().cordoned
    assert second.state == "draining"
    assert second.node.reload().cordoned


def test_two_passes_following_the_same_machine_move_it_and_say_so_once(operator_api, receiver):
    """Passes do not lock each other out of following machines: one that read a machine before
    another moved it changes nothing and writes no second event."""
    from maintenance import services as maintenance_services

    pool = PoolFactory(name="general")
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret")
    ops = PoolOperations.objects.get(pool=pool)
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    ProviderMachine.objects.create(pool=pool, provider="webhook", name="m-0", node=node, state="enrolled",
                                   requested_at=timezone.now() - timedelta(seconds=20))  # fmt: skip
    first, late = ProviderMachine.objects.get(name="m-0"), ProviderMachine.objects.get(name="m-0")
    machines._follow(first, ops, ACTOR, timezone.now())
    ready_at = ProviderMachine.objects.get(name="m-0").ready_at
    machines._follow(late, ops, ACTOR, timezone.now() + timedelta(seconds=5))
    assert ProviderMachine.objects.get(name="m-0").ready_at == ready_at
    events = NodeEvent.objects.filter(subject_type="machine", subject_id=str(first.pk))
    assert list(events.values_list("to_state", flat=True)) == ["ready"]

    ProviderMachine.objects.filter(name="m-0").update(state="draining")
    maintenance_services.retire_node(
        node_id=node.pk, expected_version=node.reload().version, reason="gone", actor=ACTOR, force=True
    )
    first, late = ProviderMachine.objects.get(name="m-0"), ProviderMachine.objects.get(name="m-0")
    machines._follow(first, ops, ACTOR, timezone.now())
    machines._follow(late, ops, ACTOR, timezone.now())
    assert ProviderMachine.objects.get(name="m-0").state == "deleted"
    assert list(events.order_by("id").values_list("to_state", flat=True)) == ["ready", "deleted"]


def test_one_machine_the_provider_fails_to_delete_does_not_stop_the_pass(operator_api, receiver, monkeypatch):
    """Following the pool's machines, a provider error on one (or a deadlock victim) is logged and
    that machine is followed again next pass; the others move on in this one."""
    from operations.providers import ProviderError

    pool = idle_machines(operator_api, receiver, min_nodes=0, scale_down_after=0)
    for machine in ProviderMachine.objects.filter(pool=pool):
        ProviderMachine.objects.filter(pk=machine.pk).update(state="draining")
        set_lifecycle(machine.node, "maintenance")
    deleted = []

    class Provider:
        def delete(self, name, data):
            if name == "m-0":
                raise ProviderError("the provider answered 503")
            deleted.append(name)

    monkeypatch.setattr(providers, "provider_for", lambda ops: Provider())
    machines.follow_machines(pool_id=pool.pk, actor=ACTOR, now=timezone.now())
    assert deleted == ["m-1"]
    assert ProviderMachine.objects.get(name="m-0").state == "deleting"  # claimed; the next pass asks again
    assert ProviderMachine.objects.get(name="m-1").state == "deleted"


def _drained_machine(operator_api, receiver):
    """Pool ``general`` on the webhook provider with machine m-0 being removed, its node drained."""
    pool = PoolFactory(name="general")
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret")
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    set_lifecycle(node, "maintenance")
    ProviderMachine.objects.create(pool=pool, provider="webhook", name="m-0", node=node, state="draining",
                                   requested_at=timezone.now() - timedelta(minutes=5))  # fmt: skip
    return pool, node


def test_a_pass_that_read_a_machine_before_another_deleted_it_does_not_delete_it_again(operator_api, receiver):
    """The machine's move is claimed (compare-and-swap) before the provider is called: the pass
    that loses the claim never asks the provider to delete the machine a second time."""
    pool, node = _drained_machine(operator_api, receiver)
    ops = PoolOperations.objects.get(pool=pool)
    first, late = ProviderMachine.objects.get(name="m-0"), ProviderMachine.objects.get(name="m-0")
    machines._follow(first, ops, ACTOR, timezone.now())
    machines._follow(late, ops, ACTOR, timezone.now())
    assert [r["action"] for r in receiver.requests] == ["delete"]
    assert ProviderMachine.objects.get(name="m-0").state == "deleted"
    assert node.reload().lifecycle == "retired"


def test_a_machine_the_provider_fails_to_delete_is_left_to_the_next_pass(operator_api, receiver, monkeypatch):
    """The claim stays when the provider fails: the machine stays ``deleting`` (its node not
    retired) and the next pass deletes it."""
    from operations.providers import ProviderError

    pool, node = _drained_machine(operator_api, receiver)
    calls = []

    class Provider:
        def delete(self, name, data):
            calls.append(name)
            if len(calls) == 1:
                raise ProviderError("the provider answered 503")

    monkeypatch.setattr(providers, "provider_for", lambda ops: Provider())
    machines.follow_machines(pool_id=pool.pk, actor=ACTOR, now=timezone.now())
    machine = ProviderMachine.objects.get(name="m-0")
    assert machine.state == "deleting"
    assert node.reload().lifecycle == "maintenance"
    machines.follow_machines(pool_id=pool.pk, actor=ACTOR, now=timezone.now())
    assert calls == ["m-0", "m-0"]
    assert ProviderMachine.objects.get(name="m-0").state == "deleted"
    assert node.reload().lifecycle == "retired"


def test_a_boot_timeout_racing_the_machine_becoming_ready_does_not_delete_the_ready_machine(
    operator_api, receiver, monkeypatch
):
    """A pass reads the machine enrolled, its node still admitting, past the boot timeout; before
    it fails the machine, another pass finds the node ready and marks the machine ready. The late
    pass must not delete that machine at the provider nor retire its node (it did, then lost the
    compare-and-swap: a machine recorded ready whose node was retired and machine deleted)."""
    pool = PoolFactory(name="general")
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              boot_timeout=60)  # fmt: skip
    ops = PoolOperations.objects.get(pool=pool)
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    set_lifecycle(node, "admitting")
    requested = timezone.now() - timedelta(seconds=120)
    ProviderMachine.objects.create(pool=pool, provider="webhook", name="m-0", node=node, state="enrolled",
                                   requested_at=requested)  # fmt: skip
    late = ProviderMachine.objects.get(name="m-0")
    real = machines._fail_machine

    def the_node_became_ready_and_another_pass_saw_it(machine, *args, **kwargs):
        set_lifecycle(node, "ready")
        machines._follow(ProviderMachine.objects.get(name="m-0"), ops, ACTOR, timezone.now())
        assert ProviderMachine.objects.get(name="m-0").state == "ready"
        return real(machine, *args, **kwargs)

    monkeypatch.setattr(machines, "_fail_machine", the_node_became_ready_and_another_pass_saw_it)
    machines._follow(late, ops, ACTOR, timezone.now())
    assert receiver.requests == []
    assert ProviderMachine.objects.get(name="m-0").state == "ready"
    assert node.reload().lifecycle == "ready"


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_passes_following_a_drained_machine_at_once_delete_it_once(operator_api, receiver, monkeypatch):
    """Two passes at once (threads, each on its own connection): each read the machine draining;
    the provider's delete waits (up to 2 s) for the other pass to arrive too. Only the pass that
    claimed the machine may get there."""
    pool, node = _drained_machine(operator_api, receiver)
    arrived, calls = threading.Barrier(2), []

    class Provider:
        def delete(self, name, data):
            calls.append(name)
            with contextlib.suppress(threading.BrokenBarrierError):
                arrived.wait(2.0)

    monkeypatch.setattr(providers, "provider_for", lambda ops: Provider())
    real_follow = machines._follow
    read = threading.Barrier(2)

    def follow_once_both_read(machine, *args):
        with contextlib.suppress(threading.BrokenBarrierError):
            read.wait(5.0)  # both passes hold the machine as read (draining) before either moves it
        return real_follow(machine, *args)

    monkeypatch.setattr(machines, "_follow", follow_once_both_read)
    outcome = race(lambda i: machines.follow_machines(pool_id=pool.pk, actor=ACTOR, now=timezone.now()), 2)
    assert not outcome.errors, outcome.errors
    assert calls == ["m-0"]
    assert ProviderMachine.objects.get(name="m-0").state == "deleted"
    events = NodeEvent.objects.filter(subject_type="machine", to_state="deleted")
    assert events.count() == 1


def test_surge_nodes_belong_to_their_upgrade_until_it_ends_then_go_first(operator_api, receiver):
    from operations.choices import UpgradeState
    from operations.models import Upgrade

    pool = idle_machines(operator_api, receiver, min_nodes=0, scale_down_after=10**6)  # m-0 is never due
    upgrade = Upgrade.objects.create(pool=pool, target={"version": "2.0.0"})
    Upgrade.objects.filter(pk=upgrade.pk).update(state=UpgradeState.ROLLING)
    surge = ProviderMachine.objects.get(name="m-1")
    surge.decision = ScaleDecision.objects.create(
        pool=pool, direction="up", outcome="succeeded", count=1, reason="surge", data={"upgrade_id": str(upgrade.pk)}
    )
    surge.save()
    now = timezone.now()
    PoolOperations.objects.filter(pool=pool).update(disruption_budgets=[{"nodes": "100%"}])
    # Idle for long, but the upgrade still runs: nothing is removed.
    for minutes in (0, 20, 40):
        assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(minutes=minutes)) == 0
    assert ProviderMachine.objects.get(name="m-1").state == "ready"

    Upgrade.objects.filter(pk=upgrade.pk).update(state=UpgradeState.COMPLETED)
    # Ended: the surge node goes, without waiting scale_down_after (the other idle node stays).
    assert autoscaler.scale_down(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(minutes=41)) == 1
    assert ProviderMachine.objects.get(name="m-1").state == "draining"
    assert "surge node" in ScaleDecision.objects.filter(direction="down", outcome="requested").get().reason


def test_a_pool_that_keeps_failing_backs_off_exponentially_up_to_a_cap_and_a_ready_machine_resets_it(
    operator_api, client_api
):
    failing = Receiver("hook-secret", status=503)
    try:
        pool = PoolFactory(name="general")
        make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
        configure(operator_api, pool, provider="webhook", provider_url=failing.url, provider_secret="hook-secret",
                  scale_up_cooldown=60, scale_up_backoff_base=60, scale_up_backoff_max=300)  # fmt: skip
        occupy(client_api)
        queue(client_api, "job-1")
        now = timezone.now()
        demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=now)  # the provider answers 503
        ops = PoolOperations.objects.get(pool=pool)
        assert ops.consecutive_failures == 1
        assert abs((ops.backoff_until - now).total_seconds() - 60) < 5
        assert demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=now + timedelta(seconds=30)) == 0
        held = ScaleDecision.objects.filter(outcome="blocked").first()
        assert "backing off after 1 consecutive failure(s)" in held.reason
    finally:
        failing.close()
    # 60, 120, 240, then the cap: 300.
    waits = []
    for _ in range(4):
        machines.back_off(pool.pk, now=now)
        waits.append(round((PoolOperations.objects.get(pool=pool).backoff_until - now).total_seconds()))
    assert waits == [120, 240, 300, 300]


def test_launches_in_flight_stay_under_the_cap(operator_api, client_api, receiver):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    configure(operator_api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              max_nodes=10, max_launches_in_flight=2)  # fmt: skip
    occupy(client_api)
    for n in range(5):
        queue(client_api, f"job-{n}")
    assert demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=timezone.now()) == 2
    assert demand.scale_up(pool_id=pool.pk, actor=ACTOR, now=timezone.now()) == 0
    assert (
        "2 launch(es) in flight (max_launches_in_flight 2)"
        in ScaleDecision.objects.filter(outcome="blocked").first().reason
    )
    assert ProviderMachine.objects.filter(pool=pool).count() == 2


def test_no_transaction_is_open_during_the_providers_delete_and_a_failed_delete_is_retried(
    operator_api, receiver, monkeypatch
):
    """The removal is claimed (state deleting) and committed before the provider is called, so no
    row lock is held during the call; a delete that fails leaves the machine deleting, and the
    next pass deletes it again and records the removal once."""
    from django.db import connection

    pool, node = _drained_machine(operator_api, receiver)
    baseline = len(connection.savepoint_ids)  # the test's own transaction
    seen, fail = [], [True]

    class Provider:
        def delete(self, name, data):
            seen.append((ProviderMachine.objects.get(name=name).state, len(connection.savepoint_ids) - baseline))
            if fail[0]:
                raise providers.ProviderError("HTTP 503")

    monkeypatch.setattr(providers, "provider_for", lambda ops: Provider())
    machines.follow_machines(pool_id=pool.pk, actor=ACTOR, now=timezone.now())
    assert seen == [("deleting", 0)]
    assert ProviderMachine.objects.get(name="m-0").state == "deleting"
    assert node.reload().lifecycle == "maintenance"

    fail[0] = False
    machines.follow_machines(pool_id=pool.pk, actor=ACTOR, now=timezone.now())
    machines.follow_machines(pool_id=pool.pk, actor=ACTOR, now=timezone.now())
    assert len(seen) == 2
    assert ProviderMachine.objects.get(name="m-0").state == "deleted"
    assert node.reload().lifecycle == "retired"
    assert NodeEvent.objects.filter(subject_type="machine", to_state="deleted").count() == 1
