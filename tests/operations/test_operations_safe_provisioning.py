"""Safe provisioning (issue 34 item 6): a pool whose machines never register backs off
exponentially, keeps its launches in flight under the cap and hands its waiting requests to its
fallback pool; work that waits on something other than capacity launches nothing; an empty
autoscaled pool scales up from zero; two passes at once never launch past the cap; bad settings
are refused naming the field."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.cache import cache
from django.utils import timezone

from fleet.events import Actor
from fleet.models import NodeEvent
from leases.models import LeaseRequest
from operations import demand, machines
from operations.models import PoolOperations, ProviderMachine, ScaleDecision
from tests.egress_support import allow_loopback
from tests.factories import PoolFactory, make_schedulable_node
from tests.maintenance_support import make_lease
from tests.operations.test_operations_autoscaling import Receiver, configure, queue
from tests.races import Hold, race

pytestmark = pytest.mark.django_db
ACTOR = Actor.system("system:autoscaler")
BUSY = {"cpu": 4000, "memory": 2**34}


@pytest.fixture(autouse=True)
def _fresh_cache(settings):
    cache.clear()
    allow_loopback(settings)


@pytest.fixture
def receivers():
    made = {}

    def receiver(name):
        made[name] = made.get(name) or Receiver("hook-secret")
        return made[name]

    yield receiver
    for r in made.values():
        r.close()


def autoscaled(api, name, receiver, **fields):
    """Pool ``name`` on a webhook provider (machines are accepted, and never register)."""
    pool = PoolFactory(name=name)
    configure(api, pool, provider="webhook", provider_url=receiver.url, provider_secret="hook-secret",
              min_nodes=0, **fields)  # fmt: skip
    return pool


def fill(api, pool):
    """One full node, so queued requests wait for a new one."""
    make_schedulable_node(pool, resources=dict(BUSY))
    body = {"workload_id": f"busy-{pool.name}", "pool": pool.name, "resources": {"cpu": "4"}}
    assert api.post("/api/v1/node-leases", body, format="json").status_code == 201


def test_a_pool_whose_machines_never_register_backs_off_keeps_launches_under_the_cap_and_tries_its_fallback(
    operator_api, client_api, receivers
):
    spare = autoscaled(operator_api, "spare", receivers("spare"), max_nodes=5)
    general = autoscaled(operator_api, "general", receivers("general"), max_nodes=10, max_launches_in_flight=2,
                         boot_timeout=60, scale_up_backoff_base=30, scale_up_backoff_max=100,
                         fallback_pools=["spare"])  # fmt: skip
    fill(client_api, general)
    for n in range(4):
        queue(client_api, f"job-{n}")  # 3 CPUs each: one template node (4 CPUs) apiece
    t0 = timezone.now()

    assert demand.scale_up(pool_id=general.pk, actor=ACTOR, now=t0) == 2  # the cap, not the 4 wanted
    assert demand.scale_up(pool_id=general.pk, actor=ACTOR, now=t0 + timedelta(seconds=10)) == 0
    assert "2 launch(es) in flight (max_launches_in_flight 2)" in ScaleDecision.objects.first().reason

    # Neither machine registers: both fail at the boot timeout, and the pool backs off 30 × 2^1 s.
    machines.follow_machines(pool_id=general.pk, actor=ACTOR, now=t0 + timedelta(seconds=61))
    assert ProviderMachine.objects.filter(pool=general, state="failed").count() == 2
    ops = PoolOperations.objects.get(pool=general)
    assert ops.consecutive_failures == 2
    assert round((ops.backoff_until - (t0 + timedelta(seconds=61))).total_seconds()) == 60

    # Backing off: the waiting requests go to the fallback pool, which launches for them.
    assert demand.scale_up(pool_id=general.pk, actor=ACTOR, now=t0 + timedelta(seconds=70)) == 4
    assert ProviderMachine.objects.filter(pool=general).count() == 2  # nothing more here
    assert ProviderMachine.objects.filter(pool=spare, state="requested").count() == 4
    moved = LeaseRequest.objects.filter(state="pending", pool=spare)
    assert sorted(r.workload_id for r in moved) == ["job-0", "job-1", "job-2", "job-3"]
    assert {r.spec["pool"] for r in moved} == {"spare"}
    held = ScaleDecision.objects.filter(pool=general, outcome="blocked").first()
    assert "backing off after 2 consecutive failure(s)" in held.reason
    assert "4 request(s) handed to fallback pool spare" in held.reason
    assert ScaleDecision.objects.get(pool=spare).data["fallback_of"] == "general"
    assert NodeEvent.objects.filter(type="lease", subject_type="lease_request").count() == 4

    # The next failures double the wait, up to the cap.
    waits = []
    for _ in range(2):
        machines.back_off(general.pk, now=t0)
        waits.append(round((PoolOperations.objects.get(pool=general).backoff_until - t0).total_seconds()))
    assert waits == [100, 100]  # 30 × 2^2 = 120 and 30 × 2^3 = 240, capped at 100


def test_without_a_fallback_that_can_launch_the_pool_says_why_and_moves_nothing(operator_api, client_api, receivers):
    full = autoscaled(operator_api, "full", receivers("full"), max_nodes=1)
    make_schedulable_node(full, resources=dict(BUSY))  # at max_nodes
    general = autoscaled(operator_api, "general", receivers("general"), max_nodes=3, fallback_pools=["full"])
    fill(client_api, general)
    queue(client_api, "job-0")
    PoolOperations.objects.filter(pool=general).update(backoff_until=timezone.now() + timedelta(minutes=5))
    assert demand.scale_up(pool_id=general.pk, actor=ACTOR, now=timezone.now()) == 0
    assert not ProviderMachine.objects.exists()
    assert LeaseRequest.objects.get(workload_id="job-0").pool == general
    assert "held back: backing off" in ScaleDecision.objects.get(pool=general).reason


def test_work_waiting_on_its_workloads_draining_lease_launches_nothing(operator_api, client_api, receivers):
    """A request whose workload still holds a live lease waits for that lease to end (on a node
    whose drain waits on a budget), not for capacity: a new node would take nothing."""
    general = autoscaled(operator_api, "general", receivers("general"), max_nodes=3)
    fill(client_api, general)
    other = make_schedulable_node(general, resources=dict(BUSY))[0]
    make_lease(other, "db-0", resources={"cpu": 4000})
    LeaseRequest.objects.create(workload_id="db-0", pool=general, spec={"workload_id": "db-0", "pool": "general",
                                "resources": {"cpu": "3"}, "queue": True})  # fmt: skip
    for minutes in (0, 5, 10):
        later = timezone.now() + timedelta(minutes=minutes)
        assert demand.scale_up(pool_id=general.pk, actor=ACTOR, now=later) == 0
    assert not ProviderMachine.objects.exists()


def test_an_anti_affinity_request_whose_group_holds_the_templates_zone_launches_nothing(
    operator_api, client_api, receivers
):
    general = autoscaled(operator_api, "general", receivers("general"), max_nodes=3)  # template zone-a
    node = make_schedulable_node(general, resources=dict(BUSY), labels={"zone": "zone-a"})[0]
    body = {"workload_id": "r-0", "pool": "general", "resources": {"cpu": "4"},
            "spread": {"group": "r", "topology_key": "zone", "mode": "anti-affinity"}}  # fmt: skip
    assert client_api.post("/api/v1/node-leases", body, format="json").status_code == 201
    assert node.leases.count() == 1
    response = client_api.post("/api/v1/node-leases", {**body, "workload_id": "r-1", "resources": {"cpu": "1"},
                               "queue": True}, format="json")  # fmt: skip
    assert response.status_code == 202, response.content
    assert demand.scale_up(pool_id=general.pk, actor=ACTOR, now=timezone.now()) == 0
    assert not ProviderMachine.objects.exists()


def test_an_empty_autoscaled_pool_scales_up_from_zero_for_a_request_its_template_holds(
    operator_api, client_api, receivers
):
    receiver = receivers("general")
    general = autoscaled(operator_api, "general", receiver, max_nodes=3)
    assert not general.nodes.exists()
    queue(client_api, "job-0")  # 202, not 422 impossible_request: the template holds it
    too_big = {"workload_id": "huge", "pool": "general", "resources": {"cpu": "8"}, "queue": True}
    refused = client_api.post("/api/v1/node-leases", too_big, format="json")
    assert (refused.status_code, refused.json()["code"]) == (422, "impossible_request")
    assert demand.scale_up(pool_id=general.pk, actor=ACTOR, now=timezone.now()) == 1
    assert [m["template"]["resources"]["cpu"] for m in receiver.requests[0]["machines"]] == ["4"]


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_autoscaler_passes_at_once_launch_no_more_than_the_cap(operator_api, client_api, receivers):
    general = autoscaled(operator_api, "general", receivers("general"), max_nodes=10, max_launches_in_flight=2)
    fill(client_api, general)
    for n in range(4):
        queue(client_api, f"job-{n}")
    now = timezone.now()
    with Hold("operations.demand._in_flight", parties=2, timeout=2.0) as hold:
        outcome = race(lambda i: demand.scale_up(pool_id=general.pk, actor=ACTOR, now=now), 2)
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == [0, 2]
    assert ProviderMachine.objects.filter(pool=general).count() == 2
    assert hold.max_inside == 1


@pytest.mark.parametrize(
    ("body", "field", "code"),
    [
        ({"fallback_pools": ["nowhere"]}, "fallback_pools[0]", "unknown_pool"),
        ({"fallback_pools": ["general"]}, "fallback_pools[0]", "invalid_pool_operations"),
        ({"fallback_pools": ["spare", "spare"]}, "fallback_pools[1]", "invalid_pool_operations"),
        ({"fallback_pools": ["back"]}, "fallback_pools[0]", "invalid_pool_operations"),  # back → general
        ({"fallback_pools": "spare"}, "fallback_pools", "invalid_pool_operations"),
        ({"consolidate_after": -1}, "consolidate_after", "invalid_pool_operations"),
        ({"consolidate_after": "1h"}, "consolidate_after", "invalid_pool_operations"),
        ({"consolidation_min_saving": 1.5}, "consolidation_min_saving", "invalid_pool_operations"),
        ({"scale_up_backoff_base": 600, "scale_up_backoff_max": 60}, "scale_up_backoff_base",
         "invalid_pool_operations"),
        ({"scale_up_backoff_base": -5}, "scale_up_backoff_base", "invalid_pool_operations"),
        ({"max_launches_in_flight": 0}, "max_launches_in_flight", "invalid_pool_operations"),
        ({"node_template": {"resources": {"cpu": "4"}, "price": "cheap"}}, "node_template.price",
         "invalid_pool_operations"),
        ({"node_template": {"resources": {"cpu": "4"}, "price": "-1"}}, "node_template.price",
         "invalid_pool_operations"),
    ],
)  # fmt: skip
def test_bad_provisioning_and_consolidation_settings_are_refused_naming_the_field(operator_api, body, field, code):
    general = PoolFactory(name="general")
    PoolFactory(name="spare")
    back = PoolFactory(name="back")
    PoolOperations.objects.create(pool=back, fallback_pools=[general.pk])
    ops = PoolOperations.objects.create(pool=general)
    response = operator_api.patch("/api/v1/pools/general/operations", body, format="json", HTTP_IF_MATCH='"1"')
    assert response.status_code == 400, response.content
    assert response["Content-Type"].startswith("application/problem+json")
    assert (response.json()["code"], response.json()["field"]) == (code, field)
    stored = PoolOperations.objects.get(pk=ops.pk)
    assert (stored.version, stored.fallback_pools, stored.consolidate_after) == (1, [], None)
    assert (stored.scale_up_backoff_base, stored.max_launches_in_flight, stored.node_template) == (120, 10, {})


def test_fallback_pools_and_consolidation_settings_are_stored_and_shown_by_name(operator_api):
    PoolFactory(name="general")
    PoolFactory(name="spare")
    PoolFactory(name="on-demand")
    body = {"fallback_pools": ["spare", "on-demand"], "consolidate_after": 300, "consolidation_min_saving": 0.3,
            "scale_up_backoff_base": 15, "node_template": {"resources": {"cpu": "4"}, "price": "0.40"}}  # fmt: skip
    response = operator_api.patch("/api/v1/pools/general/operations", body, format="json", HTTP_IF_MATCH='"1"')
    assert response.status_code == 200, response.content
    shown = operator_api.get("/api/v1/pools/general/operations").json()
    assert shown["fallback_pools"] == ["spare", "on-demand"]
    assert (shown["consolidate_after"], shown["consolidation_min_saving"]) == (300, 0.3)
    assert (shown["scale_up_backoff_base"], shown["node_template"]["price"]) == (15, "0.40")
