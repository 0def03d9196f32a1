"""The node list's label filter speaks Kubernetes' label-selector grammar; bad selectors are 400."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from fleet.labelselector import Requirement, SelectorError, parse_selector
from tests.factories import NodeFactory

NODES = "/api/v1/nodes"


@pytest.mark.parametrize(
    ("selector", "requirements"),
    [
        ("zone=a", [Requirement("zone", "=", ("a",))]),
        ("zone==a", [Requirement("zone", "=", ("a",))]),
        ("zone!=a", [Requirement("zone", "!=", ("a",))]),
        ("zone in (a, b)", [Requirement("zone", "in", ("a", "b"))]),
        ("zone notin (a)", [Requirement("zone", "notin", ("a",))]),
        ("gpu,!spot", [Requirement("gpu", "exists"), Requirement("spot", "!exists")]),
        ("topology.kubernetes.io/zone in (a,b),tier=web",
         [Requirement("topology.kubernetes.io/zone", "in", ("a", "b")), Requirement("tier", "=", ("web",))]),
        ("", []),
    ],
)  # fmt: skip
def test_selectors_parse_as_kubernetes_parses_them(selector, requirements):
    assert parse_selector(selector) == requirements


@pytest.mark.parametrize(
    "selector",
    ["zone=a,", ",zone", "zone in (a", "zone in a,b)", "zone in ()", "!zone=a", "bad key=x", "zone=a b",
     "zone=" + "x" * 64, "zone in ((a))", "=a", "x" * 1001],
)  # fmt: skip
def test_malformed_selectors_are_refused(selector):
    with pytest.raises(SelectorError):
        parse_selector(selector)


@pytest.fixture
def fleet(db):
    return {
        "a": NodeFactory(hostname="a", labels={"zone": "a", "tier": "web"}),
        "b": NodeFactory(hostname="b", labels={"zone": "b", "gpu": "a16"}),
        "c": NodeFactory(hostname="c", labels={"zone": "c", "spot": "true"}),
        "none": NodeFactory(hostname="none", labels={}),
    }


def hostnames(api, selector: str, param: str = "label") -> set[str]:
    response = api.get(f"{NODES}?{param}={quote(selector)}&page_size=100")
    assert response.status_code == 200, response.json()
    return {n["hostname"] for n in response.json()["results"]}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("zone=a", {"a"}),
        ("zone!=a", {"b", "c", "none"}),
        ("zone in (a,b)", {"a", "b"}),
        ("zone notin (a,b)", {"c", "none"}),
        ("gpu", {"b"}),
        ("!spot", {"a", "b", "none"}),
        ("zone in (a,b,c),!gpu,tier!=db", {"a", "c"}),
    ],
)
def test_the_node_list_filters_by_selector(operator_api, fleet, selector, expected):
    assert hostnames(operator_api, selector) == expected


def test_repeated_selectors_must_all_hold(operator_api, fleet):
    response = operator_api.get(f"{NODES}?label={quote('zone in (a,b)')}&label=gpu")
    assert {n["hostname"] for n in response.json()["results"]} == {"b"}


def test_node_declared_labels_take_the_same_grammar(operator_api, db):
    NodeFactory(hostname="declares", node_labels={"accel": "a16"})
    NodeFactory(hostname="silent")
    assert hostnames(operator_api, "accel in (a16,h100)", "node_label") == {"declares"}
    assert hostnames(operator_api, "!accel", "node_label") == {"silent"}


@pytest.mark.parametrize("selector", ["zone in (a", "zone=a,,tier=web", "!zone=a", "bad key"])
def test_a_bad_selector_is_a_400_problem(operator_api, fleet, selector):
    response = operator_api.get(f"{NODES}?label={quote(selector)}")
    assert response.status_code == 400
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "invalid_filter"
