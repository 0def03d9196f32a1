"""The schema tells the truth (issue 30, item 8): every value the server sends is allowed by the
OpenAPI schema it publishes.

Seeds data in every stored state (nodes in each lifecycle, liveness, readiness input and health;
leases in each state and workload state, the unreported ``""`` included; lease requests in each
state, a cancelled one without a lease; drains; quarantines; holds; pools of both kinds; shapes),
then walks the live schema (drf-spectacular's generator, as ``/api/schema/`` serves it): every
``GET`` list without path parameters, and every detail whose path is a list's path plus
``/{id}`` or ``/{name}`` for each object that list returned, read as the operator and as an owner
(lease client). Each 200 body is validated with openapi-schema-validator's ``OAS30ReadValidator``
(OpenAPI 3.0: ``nullable``, ``readOnly``) against the operation's 200 schema. New endpoints are
covered without listing them.
"""

from __future__ import annotations

import pytest
from drf_spectacular.generators import SchemaGenerator
from openapi_schema_validator import OAS30ReadValidator, oas30_format_checker

from fleet.choices import Health, Lifecycle, Liveness
from fleet.events import Actor
from fleet.models import Node
from leases.choices import LeaseRequestState, LeaseState, WorkloadState
from leases.models import Lease, LeaseRequest
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node, place_test_hold
from tests.maintenance_support import make_lease

pytestmark = pytest.mark.django_db
MAX_DETAILS_PER_LIST = 40


def seed(owner, client_user) -> None:
    from maintenance.services import quarantine_node

    general = PoolFactory(name="general")
    from tests.marketplace_support import priced_pool

    market = priced_pool("market")
    market.kind = "marketplace"
    market.save(update_fields=["kind"])
    for lifecycle in Lifecycle.values:
        node = NodeFactory(pool=general, hostname=f"life-{lifecycle}")
        Node.objects.filter(pk=node.pk).update(lifecycle=lifecycle)
    for liveness in Liveness.values:
        for health in Health.values:
            node, _ = make_schedulable_node(general, hostname=f"n-{liveness}-{health}")
            Node.objects.filter(pk=node.pk).update(liveness=liveness, health=health, ready=health != "unhealthy")
    owned, _ = make_schedulable_node(general, hostname="owned", owner=owner)
    place_test_hold(owned)
    busy, _ = make_schedulable_node(general, hostname="busy", resources={"cpu": 64000, "memory": 64 * 2**30})
    quarantined, _ = make_schedulable_node(general, hostname="to-quarantine")
    quarantine_node(node_id=quarantined.pk, reason="seeded", evidence={"k": "v"}, actor=Actor.system("test"))
    leases = []
    for state in LeaseState.values:
        for workload_state in ["", *WorkloadState.values]:
            lease = make_lease(busy, f"w-{state}-{workload_state or 'unreported'}", resources={"cpu": 100})
            Lease.objects.filter(pk=lease.pk).update(state=state, workload_state=workload_state, client=client_user)
            leases.append(lease)
    # Usage records of ended leases: on a node without an owner (owner null) and on an owned one.
    from django.utils import timezone

    from maintenance.choices import DrainState
    from maintenance.models import Drain
    from marketplace.reconciliation import open_usage_record

    owned_lease = make_lease(owned, "w-owned", resources={"cpu": 100})
    for lease in (leases[-1], owned_lease):
        Lease.objects.filter(pk=lease.pk).update(state=LeaseState.RELEASED, ended_at=timezone.now())
        lease.refresh_from_db()
        open_usage_record(lease=lease, now=timezone.now())
    for state in DrainState.values:
        node, _ = make_schedulable_node(general, hostname=f"drain-{state}")
        Drain.objects.create(node=node, state=state, reason="seeded", deadline=timezone.now())
    for state in LeaseRequestState.values:
        LeaseRequest.objects.create(
            workload_id=f"r-{state}",
            pool=general,
            client=client_user,
            state=state,
            spec={"resources": {"cpu": "1"}},
            lease=leases[0] if state == LeaseRequestState.PLACED else None,
        )


def validator_for(schema: dict, operation: dict):
    content = operation.get("responses", {}).get("200", {}).get("content", {})
    body_schema = (content.get("application/json") or {}).get("schema")
    if body_schema is None:
        return None
    return OAS30ReadValidator({**body_schema, "components": schema["components"]}, format_checker=oas30_format_checker)


def walk(api, schema: dict) -> tuple[int, list[str]]:
    """GET every list and its objects' details; returns (bodies validated, problems found)."""
    paths = schema["paths"]
    checked, problems = 0, []

    def check(path: str, template: str) -> dict | list | None:
        nonlocal checked
        response = api.get(path)
        if response.status_code != 200 or "json" not in response.get("Content-Type", ""):
            return None
        validator = validator_for(schema, paths[template]["get"])
        if validator is None:
            return None
        body = response.json()
        checked += 1
        for error in validator.iter_errors(body):
            where = "/".join("*" if isinstance(p, int) else str(p) for p in error.absolute_path)
            problems.append(f"GET {template} at {where}: {error.message[:200]}")
        return body

    for template, item in sorted(paths.items()):
        if "get" not in item or "{" in template:
            continue
        body = check(template + ("?page_size=200" if "page_size" in str(item["get"].get("parameters")) else ""),
                     template)  # fmt: skip
        if body is None:
            continue
        results = body.get("results", body) if isinstance(body, dict) else body
        if not isinstance(results, list):
            continue
        for detail in (template + "/{id}", template + "/{name}"):
            if "get" not in paths.get(detail, {}):
                continue
            key = detail.rsplit("{", 1)[1].rstrip("}")
            for obj in results[:MAX_DETAILS_PER_LIST]:
                if isinstance(obj, dict) and obj.get(key) is not None:
                    check(f"{template}/{obj[key]}", detail)
    return checked, problems


def test_every_list_and_detail_answer_for_data_in_every_state_is_allowed_by_the_schema(
    operator_api, owner_api, client_api, owner, client_user
):
    seed(owner, client_user)
    schema = SchemaGenerator().get_schema(request=None, public=True)

    problems, total = [], 0
    for api in (operator_api, owner_api, client_api):
        checked, found = walk(api, schema)
        total += checked
        problems += found

    assert total >= 200, total  # the walk reached the lists and their objects (262 bodies when written)
    assert not problems, "\n".join(sorted(set(problems))[:60])
