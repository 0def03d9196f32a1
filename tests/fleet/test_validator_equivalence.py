"""The heartbeat's hand validator and the serializer that generates its schema agree (issue 28 step 7).

The status report is validated by hand for speed (fleet.api.heartbeat_serializers.parse_heartbeat);
the OpenAPI schema comes from fleet.api.schema.HeartbeatSerializer. Hypothesis generates
valid bodies from the serializer's shape and mutates each once: a member dropped, nulled or replaced
by any JSON value, a number just out of range, a string one character over its limit, a list one
item over its count, a duplicate, a pattern broken, an extra member. Whatever the body, the two
accept exactly the same bodies; when both refuse a targeted mutation they name the same fields, and
when both refuse a random one every field the hand validator names the serializer names too (the
hand validator stops at an item's first bad member, the serializer lists them all).

Bodies hold only what the JSON parser lets through (nodepool.api.parsers: no NUL, no lone
surrogate, integers within 64 bits, finite floats).
"""

from __future__ import annotations

import copy
import uuid
from datetime import datetime

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.exceptions import ValidationError
from rest_framework.settings import api_settings

from fleet import heartbeats as hb
from fleet.api.heartbeat_serializers import CONDITION_TYPE, LEASE_STATE, parse_heartbeat
from fleet.api.schema import HeartbeatSerializer
from fleet.health import CONDITION_STATUSES
from nodepool.api.problems import Problem
from nodepool.quantity import MAX_CANONICAL
from tests.validator_equivalence import INT64, agree, json_values, mutated, named_fields, text

condition_types = st.from_regex(CONDITION_TYPE, fullmatch=True).filter(lambda s: len(s) <= hb.MAX_CONDITION_TYPE)
lease_states = st.from_regex(LEASE_STATE, fullmatch=True).filter(lambda s: len(s) <= hb.MAX_LEASE_STATE)
# Quantities valid for their resource ("1.5" cpu is 1500m; bytes and counts take no fraction).
QUANTITIES = {"cpu": ["500m", "2", "1.5"], "memory": ["4Gi", "512Mi", "1000"], "nvidia.com/gpu": ["1", "8"]}
usage_entries = st.one_of(
    st.sampled_from([(name, q) for name, quantities in QUANTITIES.items() for q in quantities]),
    st.tuples(
        st.sampled_from([*QUANTITIES, "ephemeral-storage", "example.com/fpga"]), st.integers(0, MAX_CANONICAL - 1)
    ),
)
times = st.tuples(
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)), st.sampled_from(["Z", "+02:00"])
).map(lambda pair: pair[0].isoformat() + pair[1])

conditions = st.fixed_dictionaries(
    {"type": condition_types, "status": st.sampled_from(CONDITION_STATUSES)},
    optional={"reason": st.none() | text(hb.MAX_REASON), "message": st.none() | text(64)},
)
leases = st.fixed_dictionaries(
    {
        "lease_id": st.uuids().map(str) | st.uuids().map(lambda u: str(u).upper()),
        "fencing_token": st.integers(0, INT64 - 1),
        "state": lease_states,
    }
)
bodies = st.fixed_dictionaries(
    {
        "incarnation": st.integers(1, hb.MAX_COUNTER - 1),
        "sequence": st.integers(0, hb.MAX_COUNTER - 1),
        "observed_at": times,
    },
    optional={
        "agent_version": st.none() | text(hb.MAX_AGENT_VERSION),
        "ready": st.booleans(),
        "ready_reason": st.none() | text(hb.MAX_READY_REASON),
        "conditions": st.none() | st.lists(conditions, max_size=4, unique_by=lambda c: c["type"]),
        "usage": st.none() | st.lists(usage_entries, max_size=4, unique_by=lambda e: e[0]).map(dict),
        "leases": st.none() | st.lists(leases, max_size=4, unique_by=lambda item: item["lease_id"].lower()),
        "devices": st.none() | json_values,
        "boot_id": st.none() | text(64),
        "benchmark": st.none(),
        "a_member_of_a_later_agent": json_values,
    },
)


# --- what each says -------------------------------------------------------------------------------


def _problem_fields(exc: Problem) -> list[str]:
    return [error["field"] for error in exc.extra.get("errors", [])] or [exc.extra.get("field", "")]


def by_hand(body) -> list[str] | None:
    """None when parse_heartbeat accepts ``body``, else the fields its refusal names."""
    try:
        parse_heartbeat(copy.deepcopy(body))
    except ValidationError as exc:
        return named_fields(exc.detail, body=api_settings.NON_FIELD_ERRORS_KEY)
    except Problem as exc:  # 422 over a limit, 400 invalid_quantity, 400 timezone_required
        return _problem_fields(exc)
    return None


def by_schema(body) -> list[str] | None:
    """None when the schema's serializer accepts ``body``, else the fields its errors name."""
    serializer = HeartbeatSerializer(data=copy.deepcopy(body))
    try:
        valid = serializer.is_valid()
    except Problem as exc:  # timezone_required
        return _problem_fields(exc)
    return None if valid else named_fields(serializer.errors, body=api_settings.NON_FIELD_ERRORS_KEY)


# --- mutations ------------------------------------------------------------------------------------


def _text_of(length: int) -> str:
    return "x" * length


def _valid_condition(index: int) -> dict:
    return {"type": f"Condition{index}", "status": "False"}


def _valid_lease() -> dict:
    return {"lease_id": str(uuid.uuid4()), "fencing_token": 1, "state": "running"}


# Targeted mutations: (name, how) — ``how(body)`` changes the body in place; both must name the same fields.
TEXT_LIMITS = {
    "agent_version": hb.MAX_AGENT_VERSION,
    "ready_reason": hb.MAX_READY_REASON,
    "boot_id": 64,
}


def _set(key, value):
    def how(body):
        body[key] = value

    return how


def _condition(**changes):
    def how(body):
        body["conditions"] = [_valid_condition(0), {**_valid_condition(1), **changes}]

    return how


def _lease(**changes):
    def how(body):
        body["leases"] = [_valid_lease(), {**_valid_lease(), **changes}]

    return how


TARGETED = {
    "incarnation 0": _set("incarnation", 0),
    "incarnation 2**53": _set("incarnation", hb.MAX_COUNTER),
    "incarnation 2**53-1": _set("incarnation", hb.MAX_COUNTER - 1),
    "incarnation as a string": _set("incarnation", "3"),
    "incarnation as a float": _set("incarnation", 3.0),
    "incarnation as true": _set("incarnation", True),
    "sequence -1": _set("sequence", -1),
    "sequence 2**53": _set("sequence", hb.MAX_COUNTER),
    "observed_at without an offset": _set("observed_at", "2026-12-03T10:00:00"),
    "observed_at a date": _set("observed_at", "2026-12-03"),
    "observed_at month 13": _set("observed_at", "2026-13-03T10:00:00Z"),
    "observed_at over 64 characters": _set("observed_at", "2026-12-03T10:00:00." + "0" * 50 + "Z"),
    "observed_at a number": _set("observed_at", 1764756000),
    "ready as a string": _set("ready", "true"),
    "ready null": _set("ready", None),
    **{f"{key} at its limit": _set(key, _text_of(limit)) for key, limit in TEXT_LIMITS.items()},
    **{f"{key} over its limit": _set(key, _text_of(limit + 1)) for key, limit in TEXT_LIMITS.items()},
    **{f"{key} a number": _set(key, 5) for key in TEXT_LIMITS},
    "agent_version spaces over its limit": _set("agent_version", " " * (hb.MAX_AGENT_VERSION + 1)),
    "conditions an object": _set("conditions", {"type": "Ready"}),
    "conditions one over the count": _set("conditions", [_valid_condition(i) for i in range(hb.MAX_CONDITIONS + 1)]),
    "conditions at the count": _set("conditions", [_valid_condition(i) for i in range(hb.MAX_CONDITIONS)]),
    "a condition a string": _set("conditions", ["Ready"]),
    "a condition type twice": _condition(type="Condition0"),
    "a condition type empty": _condition(type=""),
    "a condition type with a space": _condition(type="Memory Pressure"),
    "a condition type ending in a newline": _condition(type="Ready\n"),
    "a condition type over its limit": _condition(type="C" * (hb.MAX_CONDITION_TYPE + 1)),
    "a condition type missing": _condition(type=None),
    "a condition status true": _condition(status=True),
    "a condition status lower-case": _condition(status="true"),
    "a condition reason over its limit": _condition(reason=_text_of(hb.MAX_REASON + 1)),
    "a condition message over its limit": _condition(message=_text_of(hb.MAX_MESSAGE + 1)),
    "a condition message at its limit": _condition(message=_text_of(hb.MAX_MESSAGE)),
    "a condition reason a number": _condition(reason=7),
    "a condition with an extra member": _condition(lastTransitionTime="2026-12-03T10:00:00Z"),
    "usage a list": _set("usage", ["cpu"]),
    "usage one over the count": _set("usage", {f"example.com/r{i}": 1 for i in range(hb.MAX_USAGE_ENTRIES + 1)}),
    "usage a bad resource name": _set("usage", {"not a name": 1}),
    "usage a resource name ending in a newline": _set("usage", {"cpu\n": 1}),
    "usage negative": _set("usage", {"cpu": -1}),
    "usage 2**62": _set("usage", {"memory": MAX_CANONICAL}),
    "usage a boolean": _set("usage", {"cpu": True}),
    "usage a float": _set("usage", {"cpu": 1.5}),
    "usage a bad quantity": _set("usage", {"cpu": "lots"}),
    "usage a fraction of a byte": _set("usage", {"memory": "1.5"}),
    "leases one over the count": _set("leases", [_valid_lease() for _ in range(hb.MAX_LEASES + 1)]),
    "a lease id twice, in another case": lambda body: body.update(
        leases=[(first := _valid_lease()), {**_valid_lease(), "lease_id": first["lease_id"].upper()}]
    ),
    "a lease id an integer": _lease(lease_id=12345),
    "a lease id not a uuid": _lease(lease_id="lease-1"),
    "a lease token negative": _lease(fencing_token=-1),
    "a lease token a string": _lease(fencing_token="3"),
    "a lease token missing": _lease(fencing_token=None),
    "a lease state empty": _lease(state=""),
    "a lease state capitalised": _lease(state="Running"),
    "a lease state ending in a newline": _lease(state="running\n"),
    "a lease state over its limit": _lease(state="r" * (hb.MAX_LEASE_STATE + 1)),
    "devices not a list": _set("devices", "gpu"),
    "a body that is a list": None,
}


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(bodies, TARGETED))
def test_the_hand_validator_accepts_exactly_what_the_schema_serializer_accepts(case):
    agree(by_hand, by_schema, *case)


def test_every_targeted_mutation_is_judged_alike():
    """Each targeted mutation once, on the smallest valid body (hypothesis may not draw them all)."""
    for name, how in TARGETED.items():
        body = {"incarnation": 1, "sequence": 0, "observed_at": "2026-12-03T10:00:00Z"}
        if how is None:
            agree(by_hand, by_schema, [body], True)
            continue
        how(body)
        try:
            agree(by_hand, by_schema, body, True)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
