"""The schema tells the truth (issue 30, item 8): every value the server sends is allowed by the
OpenAPI schema it publishes.

Seeds data in every stored state (nodes in each lifecycle, liveness, readiness input and health;
leases in each state and workload state, the unreported ``""`` included; lease requests in each
state, a cancelled one without a lease; drains; quarantines; holds; pools of both kinds; shapes;
evidence intervals open and closed; quarantine appeals and line appeals in each state; statements
with usage, idle and correction lines; payouts in each state; payout holds active and released;
pool periods in each state with open and resolved mismatch items; upgrades, machines and scale
decisions in each state; bootstrap tokens live and revoked; disruption budgets of both limits;
consistency reports with and without drift),
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
    # Execution evidence as the owner sees it: a closed interval, and an open one (close_reason "").
    from leases.choices import EvidenceClose
    from leases.models import EvidenceInterval

    live_owned = make_lease(owned, "w-owned-live", resources={"cpu": 100})
    for lease, closed in ((owned_lease, True), (live_owned, False)):
        EvidenceInterval.objects.create(
            lease=lease,
            node=owned,
            node_incarnation=1,
            fencing_token=lease.fencing_token,
            started_at=timezone.now(),
            last_seen_at=timezone.now(),
            closed_at=timezone.now() if closed else None,
            close_reason=EvidenceClose.values[0] if closed else "",
            usage_max={"cpu": 50},
        )
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
    seed_money(owner, market)
    seed_operations(general, owner)


def seed_money(owner, market) -> None:
    """Marketplace objects in each state: a final statement with usage, idle and correction lines;
    payouts in every state; holds active and released; line appeals open and resolved; pool periods
    pending, mismatched and reconciled with open and resolved mismatch items; quarantine appeals."""
    from datetime import timedelta
    from decimal import Decimal

    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from fleet.models import Pool
    from maintenance.models import Quarantine
    from marketplace.choices import (
        AppealState,
        HoldReason,
        LineAppealState,
        LineKind,
        MismatchKind,
        PayoutState,
        PoolPeriodState,
    )
    from marketplace.models import Appeal, Statement, StatementLine, UsageRecord
    from marketplace.models.payouts import LineAppeal, Payout, PayoutHold
    from marketplace.models.periods import MismatchItem, PoolPeriod
    from tests.marketplace_support import owned_node

    now = timezone.now()
    start = (now - timedelta(days=3)).replace(hour=0, minute=0, second=0, microsecond=0)
    operator = get_user_model().objects.filter(is_staff=True).first() or owner
    node, _ = owned_node(market, owner, "money")
    record = UsageRecord.objects.filter(owner=owner).first()
    # The seeded usage already opened the owner's statement of the current period (statements.
    # statement_for): a day that starts it (the 1st, three days ago on a month's 4th) is taken.
    while Statement.objects.filter(owner=owner, period_start=start).exists():
        start -= timedelta(days=1)
    statement = Statement.objects.create(
        owner=owner,
        period="day",
        period_start=start,
        period_end=start + timedelta(days=1),
        totals={"EUR": "12.50"},
    )
    UsageRecord.objects.filter(pk=record.pk).update(state="reconciled", reconciled_at=now)
    periods = []
    for i, state in enumerate(PoolPeriodState.values):
        period = PoolPeriod.objects.create(
            pool=market,
            period="day",
            period_start=start + timedelta(days=i),
            period_end=start + timedelta(days=i + 1),
            offered={"cpu": "1.000"},
            usage={"cpu": "0.500"},
            idle={"cpu": "0.500"},
            unallocated={},
            money={"EUR": {"usage": "1.00", "idle": "0.00"}},
            waiting_for="usage inside its settlement window" if state == PoolPeriodState.PENDING else "",
            runs=1,
            reconciled_at=now if state == PoolPeriodState.RECONCILED else None,
            reconciled_by="seed" if state == PoolPeriodState.RECONCILED else "",
            mismatched_since=now if state == PoolPeriodState.MISMATCHED else None,
        )
        PoolPeriod.objects.filter(pk=period.pk).update(state=state)
        periods.append(period)
    mismatched = PoolPeriod.objects.get(state=PoolPeriodState.MISMATCHED)
    for i, kind in enumerate(MismatchKind.values):
        resolved = i == 0
        MismatchItem.objects.create(
            period=mismatched,
            kind=kind,
            key=f"{kind}-{i}",
            node=node if kind != MismatchKind.IMPOSSIBLE_USAGE else None,
            usage_record=record if kind == MismatchKind.IMPOSSIBLE_USAGE else None,
            message="seeded",
            detail={"cpu": "1"},
            resolution="checked" if resolved else "",
            resolved_by=operator if resolved else None,
            resolved_at=now if resolved else None,
        )
    lines = [
        StatementLine.objects.get(usage_record=record),  # refreshed when the usage record opened
        StatementLine.objects.create(
            statement=statement,
            kind=LineKind.IDLE,
            pool_period=periods[-1],
            state="reconciled",
            node_id_text=str(node.pk),
            pool_name=market.name,
            quantities={"cpu": "0.5"},
            amount=Decimal("2.50"),
            currency="EUR",
        ),
    ]
    lines.append(
        StatementLine.objects.create(
            statement=statement,
            kind=LineKind.CORRECTION,
            corrects=lines[0],
            state="reconciled",
            node_id_text=str(node.pk),
            pool_name=market.name,
            amount=Decimal("-1.00"),
            currency="EUR",
            reason="appeal corrected",
        )
    )
    for state in LineAppealState.values[1:]:  # one line per appeal
        lines.append(
            StatementLine.objects.create(
                statement=statement,
                kind=LineKind.CORRECTION,
                corrects=lines[0],
                state="reconciled",
                node_id_text=str(node.pk),
                pool_name=market.name,
                amount=Decimal("0.50"),
                currency="EUR",
                reason=f"appealed, {state}",
            )
        )
    Statement.objects.filter(pk=statement.pk).update(state="final", finalized_at=now, finalized_by="seed")
    for i, state in enumerate(LineAppealState.values):
        resolved = state != LineAppealState.OPEN
        appeal = LineAppeal.objects.create(
            line=lines[0] if i == 0 else lines[2 + i],
            owner=owner,
            message="seeded",
            resolution="seeded" if resolved else "",
            correction_amount=Decimal("-1.00") if state == LineAppealState.CORRECTED else None,
            correction_line=lines[2] if state == LineAppealState.CORRECTED else None,
            resolved_by=operator if resolved else None,
            resolved_at=now if resolved else None,
            created_at=now,
        )
        LineAppeal.objects.filter(pk=appeal.pk).update(state=state)
    for reason, released in ((HoldReason.OUTLIER, False), (HoldReason.FLAGGED_LINE, True)):  # one per reason
        if True:
            PayoutHold.objects.create(
                statement=statement,
                reason=reason,
                message="seeded",
                detail={"line": lines[0].pk},
                created_at=now,
                released_at=now if released else None,
                released_by=operator if released else None,
                release_reason="checked" if released else "",
            )
    for i, state in enumerate(PayoutState.values):  # one payout per statement and currency
        paid = (
            statement
            if i == 0
            else Statement.objects.create(
                owner=owner,
                period="day",
                period_start=start - timedelta(days=i),
                period_end=start - timedelta(days=i - 1),
                state="final",
                totals={"EUR": "11.50"},
                finalized_at=now,
                finalized_by="seed",
            )
        )
        payout = Payout.objects.create(
            statement=paid,
            owner=owner,
            currency="EUR",
            amount=Decimal("11.50"),
            excluded_lines=[lines[1].pk] if state == PayoutState.REQUESTED else [],
            requested_by=operator,
            requested_at=now,
            approved_by=operator if state != PayoutState.REQUESTED else None,
            approved_at=now if state != PayoutState.REQUESTED else None,
            paid_at=now if state in (PayoutState.PAID, PayoutState.REVERSED) else None,
            external_reference="ref-1" if state in (PayoutState.PAID, PayoutState.REVERSED) else "",
            failed_at=now if state == PayoutState.FAILED else None,
            failure_reason="bank said no" if state == PayoutState.FAILED else "",
            reversed_at=now if state == PayoutState.REVERSED else None,
            reversal_reason="chargeback" if state == PayoutState.REVERSED else "",
        )
        Payout.objects.filter(pk=payout.pk).update(state=state)
    quarantine = Quarantine.objects.first()
    Node.objects.filter(pk=quarantine.node_id).update(owner=owner)
    for state in AppealState.values:
        resolved = state != AppealState.OPEN
        Appeal.objects.create(
            quarantine=quarantine,
            node_id=quarantine.node_id,
            owner=owner,
            statement="not my fault",
            state=state,
            resolution="seeded" if resolved else "",
            resolved_by="seed" if resolved else "",
            resolved_at=now if resolved else None,
        )
    assert Pool.objects.filter(pk=market.pk).exists()


def seed_operations(pool, owner) -> None:
    """Shapes, bootstrap tokens (live, used up, revoked), disruption budgets (both limits),
    upgrades, scale decisions and provider machines in every state, consistency reports."""
    from datetime import timedelta

    from django.utils import timezone

    from fleet.models import BootstrapToken
    from fleet.services import bootstrap_token_create
    from leases.models import ConsistencyReport, Shape
    from maintenance.models import DisruptionBudget
    from operations.choices import MachineState, ScaleDirection, ScaleOutcome, UpgradeState
    from operations.models import ProviderMachine, ScaleDecision, Upgrade

    now = timezone.now()
    Shape.objects.create(name="small", version=1, resources={"cpu": 1000, "memory": 2**30})
    Shape.objects.create(
        name="gpu",
        version=2,
        resources={"cpu": 8000, "memory": 32 * 2**30},
        features={"arch": "amd64"},
        devices=[{"type": "gpu", "count": 1, "constraints": {}, "colocate": False}],
        description="one GPU",
    )
    live, _ = bootstrap_token_create(pool=pool, expires_at=now + timedelta(days=1), max_uses=3, description="live")
    revoked, _ = bootstrap_token_create(pool=pool, expires_at=now + timedelta(days=1), owner=owner)
    BootstrapToken.objects.filter(pk=revoked.pk).update(revoked_at=now, uses=1)
    DisruptionBudget.objects.create(group="web", max_unavailable=1)
    DisruptionBudget.objects.create(group="db", min_available=2, description="keep two")
    for state in UpgradeState.values:  # one active upgrade per pool
        upgrade = Upgrade.objects.create(
            pool=PoolFactory(name=f"upgrade-{state}"), target={"agent_version": "2.0"}, reason=f"seeded {state}"
        )
        Upgrade.objects.filter(pk=upgrade.pk).update(state=state)
    decisions = []
    for direction in ScaleDirection.values:
        for outcome in ScaleOutcome.values:
            decisions.append(
                ScaleDecision.objects.create(
                    pool=pool,
                    direction=direction,
                    outcome=outcome,
                    count=1,
                    reason="seeded",
                    error="boom" if outcome == ScaleOutcome.FAILED else "",
                    finished_at=now if outcome != ScaleOutcome.REQUESTED else None,
                )
            )
    machine_node, _ = make_schedulable_node(pool, hostname="machine-node")
    for state in MachineState.values:
        ProviderMachine.objects.create(
            pool=pool,
            provider="simulated",
            name=f"m-{state}",
            state=state,
            decision=decisions[0],
            bootstrap_token=live,
            node=machine_node if state == MachineState.READY else None,
            requested_at=now,
            pending_since=now - timedelta(seconds=30),
            ready_at=now if state == MachineState.READY else None,
            deleted_at=now if state == MachineState.DELETED else None,
        )
    ConsistencyReport.objects.create(nodes_checked=3)
    ConsistencyReport.objects.create(
        nodes_checked=3, drift=[{"node_id": 1, "resource": "cpu", "allocated": 100, "leased": 0}], repaired=True
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

    # The walk reached the lists and their objects: 342 bodies (262 before the money and operations seeds).
    assert total >= 340, total
    assert not problems, "\n".join(sorted(set(problems))[:60])
