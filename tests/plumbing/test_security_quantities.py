"""Quantities follow Kubernetes' grammar exactly; any failure is 400 invalid_quantity (issue 11, item 9)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.k8s_import import map_node
from fleet.models import Node
from nodepool.quantity import MAX_CANONICAL, QuantityError, format_quantity, parse_decimal, to_canonical
from tests.factories import PoolFactory, make_schedulable_node
from tests.fleet_support import enroll, enrollment, fresh_throttles, make_pool, make_token, node_api  # noqa: F401
from tests.heartbeat_support import beat
from tests.problems import assert_problem

RESOURCES = ["cpu", "memory", "ephemeral-storage", "pods", "nvidia.com/gpu"]


@pytest.mark.parametrize(
    "text",
    [
        "١",
        "１",
        "1١",
        " 1",
        "1 ",
        "1\n",
        "\t2",
        "1 Gi",
        "+ 1",
        "1e999999999",
        "1E-999999999",
        "9" * 65,
        "1e31",
        "1e3m",
        "12E-1k",
        "1Kb",
        "e3",
        "1..0",
        "0x10",
    ],
)
def test_non_ascii_digits_spaces_and_huge_exponents_are_refused(text):
    with pytest.raises(QuantityError):
        to_canonical("cpu", text)


@pytest.mark.parametrize(
    ("resource", "text"),
    [("cpu", "0.0001m"), ("cpu", "1.0005"), ("cpu", "1u"), ("memory", "1.5"), ("memory", "100m"), ("pods", "0.5")],
)
def test_precision_finer_than_the_canonical_unit_is_refused_not_rounded(resource, text):
    with pytest.raises(QuantityError, match="finer"):
        to_canonical(resource, text)


@pytest.mark.parametrize(
    ("resource", "text", "canonical"),
    [
        ("cpu", "500m", 500),
        ("cpu", "1.5", 1500),
        ("cpu", "+2", 2000),
        ("cpu", ".5", 500),
        ("cpu", "5.", 5000),
        ("cpu", "1000000n", 1),
        ("memory", "4Gi", 4 * 2**30),
        ("memory", "0.5Ki", 512),
        ("memory", "1E", 10**18),
        ("memory", "1e+3", 1000),
        ("memory", "10E-1", 1),
        ("memory", "12e1", 120),
        ("pods", "110", 110),
    ],
)
def test_the_kubernetes_grammar_is_accepted(resource, text, canonical):
    assert to_canonical(resource, text) == canonical


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.text(max_size=80), st.from_regex(r"[+-]?[0-9]{0,30}\.?[0-9]{0,30}([eE][+-]?[0-9]{1,12}|[KMGTPE]i?|[numk])?")
    )
)
def test_arbitrary_text_gives_a_value_or_a_quantity_error_never_another_exception(text):
    for resource in RESOURCES:
        try:
            value = to_canonical(resource, text)
        except QuantityError:
            continue
        assert isinstance(value, int) and 0 <= value <= MAX_CANONICAL
        assert to_canonical(resource, format_quantity(resource, value)) == value


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.none(),
        st.lists(st.integers(), max_size=2),
    )
)
def test_arbitrary_json_values_give_a_value_or_a_quantity_error(value):
    with contextlib.suppress(QuantityError):
        parse_decimal(value)


# --- the three endpoints and the importer -----------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.usefixtures("fresh_throttles")
@pytest.mark.parametrize("quantity", ["1e999999999", "١", "0.0001m", " 1"])
def test_enrollment_capability_with_a_bad_quantity_is_400_invalid_quantity(anon_api, quantity):
    token = make_token(make_pool(name="general"))
    body = enrollment(token)
    body["capability"]["resources"]["cpu"] = quantity

    response = anon_api.post("/api/v1/node-enrollments", body, format="json")

    assert assert_problem(response, 400, "invalid_quantity")["errors"][0]["field"] == "capability.resources.cpu"
    assert not Node.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("quantity", ["1e999999999", "１", "0.0001m"])
def test_a_lease_request_with_a_bad_quantity_is_400_invalid_quantity(client_api, quantity):
    pool = PoolFactory(name="general")
    make_schedulable_node(pool)

    response = client_api.post(
        "/api/v1/node-leases", {"workload_id": "w", "pool": "general", "resources": {"cpu": quantity}}, format="json"
    )

    assert_problem(response, 400, "invalid_quantity")


@pytest.mark.django_db
@pytest.mark.parametrize("quantity", ["1e999999999", "١", "1.5"])
def test_a_heartbeats_usage_with_a_bad_quantity_is_400_invalid_quantity(quantity):
    node, secret = make_schedulable_node(PoolFactory())
    before = Node.objects.values_list("sequence", flat=True).get(pk=node.pk)

    response = node_api(secret).post(
        f"/api/v1/nodes/{node.pk}/heartbeats", beat(1000, usage={"memory": quantity}), format="json"
    )

    assert_problem(response, 400, "invalid_quantity")
    assert Node.objects.values_list("sequence", flat=True).get(pk=node.pk) == before


def test_the_importer_reports_a_bad_quantity_as_an_unmapped_line():
    node = {
        "metadata": {"name": "n1", "uid": "u1", "labels": {}},
        "status": {
            "capacity": {"cpu": "1e999999999", "memory": "１Gi", "pods": "110"},
            "allocatable": {"cpu": "0.0001m", "memory": "8Gi", "pods": "110"},
        },
    }

    mapped = map_node(node)

    text = "\n".join(mapped.unmapped)
    assert "capacity.cpu" in text and "capacity.memory" in text and "allocatable.cpu" in text
