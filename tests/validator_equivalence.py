"""What the two equivalence tests share (issue 28 step 7: a hand validator on the hot path and the
serializer the OpenAPI schema comes from must accept the same bodies and name the same fields):
the JSON values they draw, the key paths of a body, the one-change mutation of a valid body, and
the comparison of the two verdicts. Each test keeps its own bodies, targeted mutations, and
readers of its validators' errors (tests/fleet/ and tests/leases/test_validator_equivalence.py).
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import strategies as st
from rest_framework.settings import api_settings

INT64 = 2**63
CHARACTERS = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")


def text(max_size: int, min_size: int = 0):
    return st.text(CHARACTERS, min_size=min_size, max_size=max_size)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-INT64, INT64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | text(12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(text(8), children, max_size=3),
    max_leaves=8,
)  # fmt: skip


def paths(value, prefix=()):
    """Every member and item of ``value``, as key paths."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        yield (*prefix, key)
        yield from paths(item, (*prefix, key))


def at(body, path):
    """The container of ``path``'s last key."""
    for key in path[:-1]:
        body = body[key]
    return body


@st.composite
def mutated(draw, bodies, targeted: dict[str, Callable | None]):
    """``(body, exact)``: a body of ``bodies`` mutated once (a member dropped, a value replaced by
    any JSON, or one of ``targeted``: name → a function that changes the body in place, None for
    "the body as a list"); ``exact`` when both validators must name the same fields."""
    body = draw(bodies)
    kind = draw(st.sampled_from(["none", "drop", "replace", "targeted"]))
    every = list(paths(body))
    if kind == "drop":
        path = draw(st.sampled_from([p for p in every if isinstance(at(body, p), dict)]))
        del at(body, path)[path[-1]]
        return body, True
    if kind == "replace":
        path = draw(st.sampled_from(every))
        at(body, path)[path[-1]] = draw(json_values)
        return body, False
    if kind == "targeted":
        name = draw(st.sampled_from(sorted(targeted)))
        if targeted[name] is None:
            return [body], True
        targeted[name](body)
        return body, True
    return body, True


def agree(by_hand: Callable, by_schema: Callable, body, exact: bool) -> None:
    """Both accept ``body`` (None), or both refuse it: naming the same fields when ``exact``, else
    the hand validator naming one of the serializer's (a replaced value may break several rules)."""
    hand, schema = by_hand(body), by_schema(body)
    assert (hand is None) == (schema is None), f"hand {hand}, schema {schema} for {body!r:.2000}"
    if hand is None:
        return
    assert hand, body
    if exact:
        assert set(hand) == set(schema), f"hand {hand}, schema {schema} for {body!r:.2000}"
    else:
        assert set(hand) <= set(schema), f"hand {hand}, schema {schema} for {body!r:.2000}"


def named_fields(detail, prefix: str = "", *, body: str = "") -> list[str]:
    """The fields a DRF error detail names, as the hand validators write them (``a.b``,
    ``a[2].b``); a refusal of the body itself is ``body`` (the heartbeat's validator says
    ``non_field_errors``, the lease request's ``""``)."""
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            if key == api_settings.NON_FIELD_ERRORS_KEY:
                path = prefix or body
            elif isinstance(key, int):
                path = f"{prefix}[{key}]"
            else:
                path = f"{prefix}.{key}" if prefix else str(key)
            out += named_fields(value, path, body=body)
        return out
    if isinstance(detail, list) and detail and not all(isinstance(item, str) for item in detail):
        return [
            field
            for index, item in enumerate(detail)
            if item
            for field in named_fields(item, f"{prefix}[{index}]", body=body)
        ]
    return [prefix]
