"""The node list's label filter speaks Kubernetes' label-selector grammar; bad selectors are 400."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from fleet.labelselector import Requirement, SelectorError, matches, parse_selector
from tests.factories import NodeFactory, PoolFactory

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
        ("gen>3,gen<7", [Requirement("gen", ">", ("3",)), Requirement("gen", "<", ("7",))]),
        ("zone in ()", [Requirement("zone", "in", ("",))]),
        ("zone notin (a,,b)", [Requirement("zone", "notin", ("a", "", "b"))]),
        ("zone=", [Requirement("zone", "=", ("",))]),
    ],
)  # fmt: skip
def test_selectors_parse_as_kubernetes_parses_them(selector, requirements):
    assert parse_selector(selector) == requirements


@pytest.mark.parametrize(
    "selector",
    ["zone=a,", ",zone", "zone in (a", "zone in a,b)", "!zone=a", "bad key=x", "zone=a b",
     "zone=" + "x" * 64, "zone in ((a))", "=a", "x" * 1001],
)  # fmt: skip
def test_malformed_selectors_are_refused(selector):
    with pytest.raises(SelectorError):
        parse_selector(selector)


# Kubernetes' own parser tests (k8s.io/apimachinery/pkg/labels/selector_test.go): TestSelectorParse's
# good and bad strings, then every input of TestSetSelectorParser, with whether Kubernetes parses it.
KUBERNETES_PARSER_STRINGS = [
    *[(s, True) for s in ("x=a,y=b,z=c", "", "x!=a,y=b", "x=", "x= ", "x=,z= ", "x= ,z= ", "!x", "x>1", "x>1,z<5")],
    *[(s, False) for s in ("x=a||y=b", "x==a==b", "!x=a", "x<a")],
    ("", True), ("\rx", True), ("this-is-a-dns.domain.com/key-with-dash", True),
    ("this-is-another-dns.domain.com/key-with-dash in (so,what)", True),
    ("0.1.2.domain/99 notin (10.10.100.1, tick.tack.clock)", True), ("foo  in\t (abc)", True),
    ("x notin\n (abc)", True), ("x  notin\t\t\t(abc,def)", True), ("x in (abc,def)", True), ("x in (abc,)", True),
    ("x in (abc,abc)", True), ("x in ()", True), ("x in (a,,)", True), ("x in (a,,,)", True),
    ("x in (a,,,,,,)", True), ("x in (a,,a,,a,,a,,)", True), ("x notin (abc,,def),bar,z in (),w", True),
    ("x,y in (a)", True), ("x=a", True), ("x>1", True), ("x<7", True), ("x=a,y!=b", True),
    ("x=a,y!=b,z in (h,i,j)", True), ("x=a||y=b", False), ("x,,y", False), (",x,y", False),
    ("x nott in (y)", False), ("x notin ( )", True), ("x notin (, a)", True), ("a in (xyz),", False),
    ("a in (xyz)b notin ()", False), ("a ", True), ("a in (x,y,notin, z,in)", True), ("a in (xyz abc)", False),
    ("a notin(", False), ("a (", False), ("(", False),
]  # fmt: skip


def test_all_51_of_kubernetes_parser_strings_agree():
    assert len(KUBERNETES_PARSER_STRINGS) == 51
    disagree = []
    for selector, valid in KUBERNETES_PARSER_STRINGS:
        try:
            parse_selector(selector)
            parsed = True
        except SelectorError:
            parsed = False
        if parsed != valid:
            disagree.append(selector)
    assert disagree == []


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [  # Kubernetes' TestSelectorMatches
        ("", {"x": "y"}, True), ("x=y", {"x": "y"}, True), ("x!=y,z!=w", {"x": "z", "z": "a"}, True),
        ("notin=in", {"notin": "in"}, True), ("x", {"x": "z"}, True), ("!x", {"y": "z"}, True),
        ("x>1", {"x": "2"}, True), ("x<1", {"x": "0"}, True), ("x=z", {}, False), ("x=y", {"x": "z"}, False),
        ("x!=y,z!=w", {"x": "z", "z": "w"}, False), ("x", {"y": "z"}, False), ("!x", {"x": "z"}, False),
        ("x>1", {"x": "0"}, False), ("x<1", {"x": "2"}, False), ("x>1", {"x": "a"}, False), ("x<1", {}, False),
        ("x in (a,b)", {"x": "b"}, True), ("x in ()", {"x": ""}, True), ("x notin (a)", {}, True),
    ],
)  # fmt: skip
def test_requirements_match_as_kubernetes_matches(selector, labels, expected):
    assert matches(parse_selector(selector), labels) is expected


@pytest.fixture
def fleet(db):
    general = PoolFactory(name="general")
    return {
        "a": NodeFactory(hostname="a", pool=general, labels={"zone": "a", "tier": "web", "gen": "3"}),
        "b": NodeFactory(hostname="b", pool=general, labels={"zone": "b", "gpu": "a16", "gen": "4"}),
        "c": NodeFactory(hostname="c", labels={"zone": "c", "spot": "true", "gen": "12"}),
        "none": NodeFactory(hostname="none", pool=general, labels={}),
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
        ("gen>3", {"b", "c"}),
        ("gen<5,gen>3", {"b"}),
        ("nodepool.dev/pool=general,zone!=c", {"a", "b", "none"}),
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


def test_the_label_filter_matches_the_labels_placement_uses(operator_api, db):
    """Node-declared labels count where the pool trusts them (as placement), not elsewhere; platform
    labels win over declared ones; pool labels and identity labels count too."""
    trusting = PoolFactory(name="trusting", trust_node_labels=True, labels={"tier": "batch"})
    wary = PoolFactory(name="wary", trust_node_labels=False)
    NodeFactory(hostname="t1", pool=trusting, node_labels={"zone": "a"})
    NodeFactory(hostname="t2", pool=trusting, node_labels={"zone": "a"}, labels={"zone": "b"})
    NodeFactory(hostname="w1", pool=wary, node_labels={"zone": "a"})
    assert hostnames(operator_api, "zone=a") == {"t1"}
    assert hostnames(operator_api, "zone=b") == {"t2"}
    assert hostnames(operator_api, "tier=batch") == {"t1", "t2"}
    assert hostnames(operator_api, "kubernetes.io/hostname in (w1,t2)") == {"w1", "t2"}
    assert hostnames(operator_api, "zone=a", "node_label") == {"t1", "t2", "w1"}
