"""Marketplace API, the settings an operator keeps: pool prices (versions with ``effective_from``),
pools' settlement windows, owner settings (statement periods) and quarantine guidance.

Views validate, call one service, and shape the response (docs/api-contract.md, "Marketplace")."""

from __future__ import annotations

import re
from decimal import Decimal

from django.contrib.auth import get_user_model
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet import liveness
from fleet.errors import POOL_NOT_FOUND, UNKNOWN_POOL
from fleet.models import Pool
from maintenance.choices import QuarantineRule
from nodepool.api.permissions import is_operator, is_owner
from nodepool.api.problems import Forbidden, NotFound, Problem

from .. import pricing, reconciliation, selectors, statements
from ..choices import StatementPeriod
from ..errors import (
    INVALID_CURRENCY,
    INVALID_DECIMAL,
    INVALID_FIELD,
    OWNER_NOT_FOUND,
    RULE_NOT_FOUND,
    SETTLEMENT_WINDOW_TOO_SHORT,
)
from ..filtersets import PoolPriceFilterSet
from ..models import OwnerSettings, PoolPrice, PoolSettlement, QuarantineGuidance
from . import serializers as s
from .common import (
    IsOperator,
    IsOperatorOrOwner,
    ReadForAllWriteForOperators,
    read_body,
    read_datetime,
    read_decimal,
    read_text,
)

RESOURCE = re.compile(r"^[a-z0-9]([a-z0-9./-]{0,61}[a-z0-9])?$")
CURRENCY = re.compile(r"^[A-Z]{3}$")


# --- prices, settlement windows, owner settings, guidance ------------------------------------------
class PoolPriceList(generics.ListCreateAPIView):
    """``GET /pool-prices`` (?pool=) and ``POST`` (operator) ``{"pool", "resource", "unit_price":
    "0.60", "currency": "EUR", "effective_from"}``: a new price version (never an edit)."""

    permission_classes = [ReadForAllWriteForOperators]
    serializer_class = s.PoolPriceSerializer
    filterset_class = PoolPriceFilterSet
    queryset = PoolPrice.objects.select_related("pool")

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: s.PoolPriceSerializer})
    def post(self, request, *args, **kwargs):
        data = read_body(request, {"pool", "resource", "unit_price", "currency", "effective_from", "note"})
        pool = Pool.objects.filter(name=data.get("pool")).first() if isinstance(data.get("pool"), str) else None
        if pool is None:
            raise Problem("pool: the name of an existing pool.", UNKNOWN_POOL, field="pool")
        resource = data.get("resource")
        if not isinstance(resource, str) or not RESOURCE.fullmatch(resource):
            raise Problem(
                "resource: a resource name such as cpu, memory or nvidia.com/gpu.", INVALID_FIELD, field="resource"
            )
        currency = data.get("currency")
        if not isinstance(currency, str) or not CURRENCY.fullmatch(currency):
            raise Problem("currency: an ISO 4217 code, three capital letters.", INVALID_CURRENCY, field="currency")
        price = pricing.set_price(
            pool=pool,
            resource=resource,
            unit_price=read_decimal(data, "unit_price"),
            currency=currency,
            effective_from=read_datetime(data, "effective_from"),
            user=request.user,
            note=read_text(data, "note", required=False, limit=200),
        )
        return Response(s.PoolPriceSerializer(price).data, status=201)


class PoolSettlementView(APIView):
    """``GET /pools/{name}/settlement`` and ``PUT`` (operator) ``{"settlement_window": seconds | null}``
    and/or the pool-period settings ``{"period": "day" | "week" | "month", "idle_paid": bool,
    "hold_multiple": "10", "appeal_alert_after": seconds}`` (docs/marketplace.md, "Pool periods")."""

    permission_classes = [IsOperator]

    def _answer(self, pool):
        row = PoolSettlement.objects.filter(pool=pool).first() or PoolSettlement(pool=pool)
        return Response(
            {
                "pool": pool.name,
                "settlement_window": row.settlement_window,
                "effective_window": reconciliation.settlement_window(pool),
                "period": row.period,
                "idle_paid": row.idle_paid,
                "hold_multiple": str(Decimal(row.hold_multiple).quantize(Decimal("0.01"))),
                "appeal_alert_after": row.appeal_alert_after,
            }
        )

    @staticmethod
    def _money_settings(data: dict) -> dict:
        values = {}
        if "period" in data:
            if data["period"] not in StatementPeriod.values:
                raise Problem("period: day, week or month.", INVALID_FIELD, field="period")
            values["period"] = data["period"]
        if "idle_paid" in data:
            if not isinstance(data["idle_paid"], bool):
                raise Problem("idle_paid: true or false.", INVALID_FIELD, field="idle_paid")
            values["idle_paid"] = data["idle_paid"]
        if "hold_multiple" in data:
            multiple = read_decimal(data, "hold_multiple")
            if multiple < 1 or multiple >= 10**6 or multiple != multiple.quantize(Decimal("0.01")):
                raise Problem(
                    "hold_multiple: at least 1, two decimals at most.", INVALID_DECIMAL, field="hold_multiple"
                )
            values["hold_multiple"] = multiple
        if "appeal_alert_after" in data:
            seconds = data["appeal_alert_after"]
            if isinstance(seconds, bool) or not isinstance(seconds, int) or not 60 <= seconds <= 10**8:
                raise Problem("appeal_alert_after: seconds (an integer, 60 or more).", INVALID_FIELD,
                              field="appeal_alert_after")  # fmt: skip
            values["appeal_alert_after"] = seconds
        return values

    def _pool(self, name):
        pool = Pool.objects.filter(name=name).first()
        if pool is None:
            raise NotFound("No such pool.", POOL_NOT_FOUND)
        return pool

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, name):
        return self._answer(self._pool(name))

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def put(self, request, name):
        pool = self._pool(name)
        data = read_body(request, {"settlement_window", "period", "idle_paid", "hold_multiple", "appeal_alert_after"})
        money = self._money_settings(data)
        if money and "settlement_window" not in data:
            PoolSettlement.objects.update_or_create(pool=pool, defaults=money)
            return self._answer(pool)
        value = data.get("settlement_window", "missing")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**8):
            raise Problem(
                "settlement_window: seconds (an integer), or null for the default.",
                INVALID_FIELD,
                field="settlement_window",
            )
        lost_after = liveness.timings_for(pool, liveness.heartbeat_population()).lost_after
        if value is not None and value <= lost_after:
            raise Problem(
                f"settlement_window must exceed the pool's loss threshold ({lost_after:g} s now).",
                SETTLEMENT_WINDOW_TOO_SHORT,
                field="settlement_window",
            )
        PoolSettlement.objects.update_or_create(pool=pool, defaults={"settlement_window": value, **money})
        return self._answer(pool)


class OwnerSettingsView(APIView):
    """``GET /owner-settings/{username}`` (the owner or an operator) and ``PUT`` (operator)
    ``{"statement_period": "month" | "week" | "day"}``: applies to statements opened from now on."""

    permission_classes = [IsOperatorOrOwner]

    def _owner(self, request, username):
        user = get_user_model().objects.filter(username=username).first()
        if user is None or not is_owner(user) or (not is_operator(request.user) and user.pk != request.user.pk):
            raise NotFound("No such owner.", OWNER_NOT_FOUND)
        return user

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, username):
        user = self._owner(request, username)
        return Response({"owner": user.username, "statement_period": statements.period_of(user.pk)})

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def put(self, request, username):
        if not is_operator(request.user):
            raise Forbidden("Only operators may change an owner's settings.")
        user = self._owner(request, username)
        period = read_body(request, {"statement_period"}).get("statement_period")
        if period not in StatementPeriod.values:
            raise Problem(
                f"statement_period must be one of {', '.join(StatementPeriod.values)}.",
                INVALID_FIELD,
                field="statement_period",
            )
        OwnerSettings.objects.update_or_create(owner=user, defaults={"statement_period": period})
        return Response({"owner": user.username, "statement_period": period})


class QuarantineGuidanceList(APIView):
    """``GET /quarantine-guidance``: every quarantine rule's next-step text for owners."""

    permission_classes = [IsOperatorOrOwner]

    @extend_schema(operation_id="v1_quarantine_guidance_list", responses=OpenApiTypes.OBJECT)
    def get(self, request):
        return Response({r: selectors.next_steps(r) for r in QuarantineRule.values})


class QuarantineGuidanceView(APIView):
    """``GET /quarantine-guidance/{rule}`` and ``PUT`` (operator) ``{"next_steps": text}``."""

    permission_classes = [IsOperatorOrOwner]

    def _rule(self, rule):
        if rule not in QuarantineRule.values:
            raise NotFound("No such quarantine rule.", RULE_NOT_FOUND)
        return rule

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request, rule):
        return Response({"rule": self._rule(rule), "next_steps": selectors.next_steps(rule)})

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def put(self, request, rule):
        if not is_operator(request.user):
            raise Forbidden("Only operators may write guidance.")
        self._rule(rule)
        text = read_text(read_body(request, {"next_steps"}), "next_steps")
        QuarantineGuidance.objects.update_or_create(
            rule=rule, defaults={"next_steps": text, "updated_by": request.user.get_username()}
        )
        return Response({"rule": rule, "next_steps": text})
