"""The lease request's hand validator and the serializer that generates its schema agree (issue 28 step 7).

``POST /node-leases`` is validated by hand (leases.spec.parse_spec, the grant's hot path); the
OpenAPI schema comes from leases.api.spec_schema.LeaseCreateRequestSerializer. Hypothesis generates
valid requests and mutates each once: a member dropped, or replaced by any JSON value, or one of
the targeted mutations below (a number just out of range, a string one character over its limit,
a list one item over its count, a pattern broken, a member of the wrong type whose value is falsy,
an extra member, a cross-member rule broken). Whatever the body, the two accept exactly the same
bodies; when both refuse a targeted mutation or a dropped member they name the same fields, and
when both refuse a random replacement every field the hand validator names the serializer names
too (the hand validator stops at the first bad member, the serializer lists them all).

Bodies hold only what the JSON parser lets through (nodepool.api.parsers: no NUL, no lone
surrogate, integers within 64 bits, finite floats). Device types beyond the well-known ones are
looked up in the database, hence ``django_db`` (no device rows: such a type is unknown).
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.exceptions import ValidationError

from leases.api.spec_schema import MAX_DEVICE_TYPE, LeaseCreateRequestSerializer
from leases.device_requests import MAX_CONSTRAINTS, MAX_COUNT, MAX_DEVICE_REQUESTS
from leases.reliability import MAX_NODE_CONSTRAINTS
from leases.spec import (
    MAX_COMMAND_ARGS,
    MAX_LABEL_VALUE,
    MAX_PRIORITY,
    MAX_SHAPE_VERSION,
    MAX_TERM_VALUES,
    MAX_TERMS,
    MAX_TOLERATION_SECONDS,
    MAX_TTL,
    parse_spec,
)
from nodepool.api.problems import Problem
from tests.validator_equivalence import INT64, agree, mutated, named_fields, text

pytestmark = pytest.mark.django_db

# Short instances of leases.spec's patterns (LABEL_KEY, WORKLOAD_ID; their lengths are targeted below):
# drawing from the full patterns and filtering cost most of the test's time.
label_keys = st.sampled_from(["zone", "topology.kubernetes.io/zone", "arch", "nodepool.dev/pool", "a.b-c/D_e.9"]) | (
    st.from_regex(r"([a-z0-9]([-a-z0-9.]{0,8}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,8}[A-Za-z0-9])?", fullmatch=True)
)
label_values = text(16)
workload_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,16}", fullmatch=True)
# Quantities valid for their resource ("1.5" cpu is 1500m; bytes and counts take no fraction).
QUANTITIES = {
    "cpu": ["500m", "2", "1.5", 2, 0.25],
    "memory": ["4Gi", "512Mi", "1000", 1024],
    "ephemeral-storage": ["10Gi"],
    "pods": ["3", 1],
    "example.com/fpga": ["1", 2],
    "amd.com/gpu": ["1"],
}
# Device requests ask for these types, resources for the ones above: a count resource of a device
# type must agree with its device requests (a targeted mutation breaks that on purpose).
DEVICE_TYPES = ["nvidia.com/gpu", "nvidia.com/mig", "habana.ai/gaudi"]
resources = st.dictionaries(st.sampled_from(sorted(QUANTITIES)), st.just(None), min_size=1, max_size=4).flatmap(
    lambda names: st.fixed_dictionaries({name: st.sampled_from(QUANTITIES[name]) for name in names})
)
requirements = st.one_of(
    st.fixed_dictionaries({"key": label_keys, "operator": st.sampled_from(["In", "NotIn"]),
                           "values": st.lists(label_values, min_size=1, max_size=2)}),
    st.fixed_dictionaries({"key": label_keys, "operator": st.sampled_from(["Exists", "DoesNotExist"])},
                          optional={"values": st.none() | st.just([])}),
    st.fixed_dictionaries({"key": label_keys, "operator": st.sampled_from(["Gt", "Lt"]),
                           "values": st.integers(-(10**17), 10**17).map(lambda n: [str(n)])}),
)  # fmt: skip
affinities = st.fixed_dictionaries(
    {},
    optional={
        "required": st.none() | st.lists(requirements, max_size=2),
        "preferred": st.none()
        | st.lists(st.fixed_dictionaries({"weight": st.integers(1, 100), "term": requirements}), max_size=2),
    },
)
EFFECTS = ["NoSchedule", "PreferNoSchedule", "NoExecute", "", None]
seconds = st.none() | st.integers(0, 10**6)
tolerations = st.one_of(
    st.fixed_dictionaries({"key": label_keys, "operator": st.sampled_from(["Equal", "", None])},
                          optional={"value": st.none() | label_values, "effect": st.sampled_from(EFFECTS),
                                    "toleration_seconds": seconds}),
    st.fixed_dictionaries({"operator": st.just("Exists")},
                          optional={"key": st.sampled_from(["", None]) | label_keys,
                                    "value": st.sampled_from(["", None]), "effect": st.sampled_from(EFFECTS),
                                    "toleration_seconds": seconds}),
)  # fmt: skip
spreads = st.fixed_dictionaries(
    {"group": workload_ids},
    optional={
        "topology_key": st.sampled_from(["host", "rack", "zone", "region", "provider", "", None]) | label_keys,
        "mode": st.sampled_from(["spread", "anti-affinity", "", None]),
    },
)
device_constraints = st.one_of(
    st.fixed_dictionaries({"attribute": st.sampled_from(["memory", "numa_node", "index"]),
                           "operator": st.sampled_from(["=", "!=", ">", ">=", "<", "<="]),
                           "value": st.sampled_from(["40Gi", "80Gi", 0, 1, 2.5, "1e3"])}),
    st.fixed_dictionaries({"attribute": st.sampled_from(["model", "mig_profile", "interconnect_group",
                                                         "driver_version", "cuda_version", "pci_bus_id"]),
                           "operator": st.sampled_from(["=", "!="]), "value": text(16)}),
    st.fixed_dictionaries({"attribute": st.sampled_from(["model", "mig_profile"]), "operator": st.just("glob"),
                           "value": text(16, min_size=1)}),
)  # fmt: skip
device_requests = st.fixed_dictionaries(
    {"type": st.sampled_from(DEVICE_TYPES)},
    optional={
        "count": st.integers(1, MAX_COUNT),
        "constraints": st.none() | st.lists(device_constraints, max_size=2),
        "colocate": st.sampled_from(["interconnect_group", "numa_node", "", None]),
    },
)
reliability = st.floats(0, 1) | st.sampled_from([0, 1, "0.99", "0.5", "1", "500m"])
node_constraints = st.fixed_dictionaries(
    {"attribute": st.just("reliability"), "operator": st.sampled_from(["=", "!=", ">", ">=", "<", "<="]),
     "value": reliability}
)  # fmt: skip
node_preferences = st.fixed_dictionaries(
    {"weight": st.integers(1, 100), "attribute": st.just("reliability"),
     "operator": st.sampled_from([">", ">="]), "value": reliability}
)  # fmt: skip
optional_members = st.fixed_dictionaries(
    {},
    optional={
        "node_selector": st.none() | st.dictionaries(label_keys, label_values, max_size=2),
        "affinity": st.none() | affinities,
        "tolerations": st.none() | st.lists(tolerations, max_size=2),
        "features": st.none()
        | st.dictionaries(text(12), st.booleans() | st.integers(-INT64, INT64 - 1) | text(12), max_size=2),
        "spread": st.none() | spreads,
        "ttl_seconds": st.none() | st.integers(1, MAX_TTL),
        "priority": st.none() | st.integers(-MAX_PRIORITY, MAX_PRIORITY),
        "queue": st.booleans(),
        "command": st.none() | st.lists(text(12), max_size=2),
        "node_constraints": st.none() | st.lists(node_constraints, max_size=2),
        "node_preferences": st.none() | st.lists(node_preferences, max_size=2),
    },
)


@st.composite
def bodies(draw):
    """A valid request: a workload and a pool, something to ask for (resources, a shape or devices,
    resources may come with devices of other types), and any optional members."""
    body = {"workload_id": draw(workload_ids), "pool": draw(text(20, min_size=1))}
    demand = draw(st.sampled_from(["resources", "shape", "devices", "resources and devices"]))
    if demand == "shape":
        body["shape"] = draw(st.sampled_from(["large", "gpu-a100", "small@2"]))
        if draw(st.booleans()):
            body["shape_version"] = draw(st.none() | st.integers(0, MAX_SHAPE_VERSION))
    if "resources" in demand:
        body["resources"] = draw(resources)
    if "devices" in demand:
        body["devices"] = draw(st.lists(device_requests, min_size=1, max_size=2))
    body.update(draw(optional_members))
    return body


# --- what each says -------------------------------------------------------------------------------


def by_hand(body) -> list[str] | None:
    """None when parse_spec accepts ``body``, else the fields its refusal names (always one)."""
    try:
        parse_spec(copy.deepcopy(body))
    except Problem as exc:
        return [error["field"] for error in exc.extra["errors"]]
    return None


# One instance, its fields bound once: what is_valid() runs, without copying the field tree per body.
SERIALIZER = LeaseCreateRequestSerializer()


def by_schema(body) -> list[str] | None:
    """None when the schema's serializer accepts ``body``, else the fields its errors name."""
    try:
        SERIALIZER.run_validation(copy.deepcopy(body))
    except ValidationError as exc:
        return named_fields(exc.detail)
    return None


# --- mutations ------------------------------------------------------------------------------------


def _set(key, value):
    def how(body):
        body[key] = value

    return how


def _item(member, valid, **changes):
    """``member`` becomes a list of a valid item and a second one with ``changes`` (None: dropped)."""

    def how(body):
        changed = {**valid, **changes}
        body[member] = [dict(valid), {k: v for k, v in changed.items() if v is not DROP}]

    return how


def _within(member, valid, **changes):
    """``member`` becomes ``valid`` with ``changes`` (an object member such as ``spread``)."""

    def how(body):
        changed = {**valid, **changes}
        body[member] = {k: v for k, v in changed.items() if v is not DROP}

    return how


DROP = object()
REQUIREMENT = {"key": "zone", "operator": "In", "values": ["a"]}
TOLERATION = {"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
SPREAD = {"group": "web", "topology_key": "zone", "mode": "spread"}
DEVICE = {"type": "nvidia.com/gpu", "count": 1}
CONSTRAINT = {"attribute": "memory", "operator": ">=", "value": "40Gi"}
NODE_CONSTRAINT = {"attribute": "reliability", "operator": ">=", "value": 0.99}


def _affinity_required(**changes):
    def how(body):
        changed = {**REQUIREMENT, **changes}
        body["affinity"] = {"required": [REQUIREMENT, {k: v for k, v in changed.items() if v is not DROP}]}

    return how


def _affinity_preferred(**changes):
    def how(body):
        changed = {"weight": 10, "term": REQUIREMENT, **changes}
        body["affinity"] = {"preferred": [{k: v for k, v in changed.items() if v is not DROP}]}

    return how


def _constraint(**changes):
    def how(body):
        changed = {**CONSTRAINT, **changes}
        body["devices"] = [{**DEVICE, "constraints": [{k: v for k, v in changed.items() if v is not DROP}]}]

    return how


FALSY = {"false": False, "0": 0, "an empty string": "", "an empty list": [], "an empty object": {}}

# Targeted mutations of the smallest valid body, {"workload_id", "pool", "resources": {"cpu": "1"}}:
# (name, how) — ``how(body)`` changes the body in place; both must name the same fields.
TARGETED = {
    # the body and its members
    "a body that is a list": None,
    "an unknown member": _set("surprise", 1),
    "workload_id missing": lambda body: body.pop("workload_id", None),
    "workload_id empty": _set("workload_id", ""),
    "workload_id at 200 characters": _set("workload_id", "w" * 200),
    "workload_id over 200 characters": _set("workload_id", "w" * 201),
    "workload_id with a space": _set("workload_id", "job 1"),
    "workload_id ending in a newline": _set("workload_id", "job\n"),
    "workload_id a number": _set("workload_id", 42),
    "pool missing": lambda body: body.pop("pool", None),
    "pool empty": _set("pool", ""),
    "pool null": _set("pool", None),
    "pool a number": _set("pool", 7),
    # resources and shapes
    "resources missing": lambda body: body.pop("resources", None),
    "resources null": _set("resources", None),
    "resources empty": _set("resources", {}),
    "resources all zero": _set("resources", {"cpu": "0", "memory": 0}),
    "resources a list": _set("resources", ["cpu"]),
    "a resource name not a name": _set("resources", {"not a name": "1"}),
    "a resource name with a colon": _set("resources", {"a:b": "1"}),
    "a resource name ending in a newline": _set("resources", {"cpu\n": "1"}),
    "an unknown resource": _set("resources", {"gpus": "1"}),
    "an extended resource": _set("resources", {"example.com/fpga": "1"}),
    "a quantity negative": _set("resources", {"cpu": "-1"}),
    "a quantity malformed": _set("resources", {"cpu": "lots"}),
    "a quantity a boolean": _set("resources", {"cpu": True}),
    "a quantity null": _set("resources", {"cpu": None}),
    "a quantity a float": _set("resources", {"cpu": 0.5}),
    "a quantity finer than a millicore": _set("resources", {"cpu": "0.0001"}),
    "a fraction of a byte": _set("resources", {"memory": "1.5"}),
    "a quantity too large": _set("resources", {"memory": "8Ei"}),
    "a shape with resources": _set("shape", "large"),
    "a shape without resources": lambda body: body.update(shape="large", resources=None),
    "a shape a number": _set("shape", 5),
    "a shape null": _set("shape", None),
    "a shape empty": _set("shape", ""),
    "shape_version -1": _set("shape_version", -1),
    "shape_version 2**31": _set("shape_version", MAX_SHAPE_VERSION),
    "shape_version over 2**31": _set("shape_version", MAX_SHAPE_VERSION + 1),
    "shape_version a string": _set("shape_version", "2"),
    # scalars
    "ttl_seconds 0": _set("ttl_seconds", 0),
    "ttl_seconds at its limit": _set("ttl_seconds", MAX_TTL),
    "ttl_seconds over its limit": _set("ttl_seconds", MAX_TTL + 1),
    "ttl_seconds a float": _set("ttl_seconds", 60.0),
    "ttl_seconds true": _set("ttl_seconds", True),
    "ttl_seconds null": _set("ttl_seconds", None),
    "priority under its range": _set("priority", -MAX_PRIORITY - 1),
    "priority over its range": _set("priority", MAX_PRIORITY + 1),
    "priority a string": _set("priority", "1"),
    "queue a string": _set("queue", "true"),
    "queue 1": _set("queue", 1),
    "queue null": _set("queue", None),
    "command a string": _set("command", "sleep 30"),
    "command with a number": _set("command", ["sleep", 30]),
    "command at its count": _set("command", ["x"] * MAX_COMMAND_ARGS),
    "command over its count": _set("command", ["x"] * (MAX_COMMAND_ARGS + 1)),
    "features a list": _set("features", ["arch"]),
    "a feature a float": _set("features", {"gpu_memory_gib": 40.5}),
    "a feature a list": _set("features", {"runtimes": ["docker"]}),
    "a feature null": _set("features", {"arch": None}),
    "a feature a boolean": _set("features", {"sgx": True}),
    **{f"{member} {name}": _set(member, value) for member in ("shape", "features", "command")
       for name, value in FALSY.items()},
    # node selector
    "node_selector a list": _set("node_selector", ["zone"]),
    "a node_selector key not a label key": _set("node_selector", {"no spaces": "a"}),
    "a node_selector key of 63 characters": _set("node_selector", {"k" * 63: "a"}),
    "a node_selector key of 64 characters": _set("node_selector", {"k" * 64: "a"}),
    "a node_selector key with a 253-character prefix": _set("node_selector", {"p" * 253 + "/k": "a"}),
    "a node_selector key with a 254-character prefix": _set("node_selector", {"p" * 254 + "/k": "a"}),
    "a node_selector key ending in a newline": _set("node_selector", {"zone\n": "a"}),
    "a node_selector value a number": _set("node_selector", {"zone": 1}),
    "a node_selector value at its limit": _set("node_selector", {"zone": "v" * MAX_LABEL_VALUE}),
    "a node_selector value over its limit": _set("node_selector", {"zone": "v" * (MAX_LABEL_VALUE + 1)}),
    # affinity
    "affinity a list": _set("affinity", [REQUIREMENT]),
    "affinity with an unknown member": _set("affinity", {"required": [], "nodeSelectorTerms": []}),
    "affinity.required an object": _set("affinity", {"required": REQUIREMENT}),
    **{f"affinity.required {name}": _set("affinity", {"required": value}) for name, value in FALSY.items()
       if value != []},
    **{f"affinity.preferred {name}": _set("affinity", {"preferred": value}) for name, value in FALSY.items()
       if value != []},
    "affinity.required over its count": _set("affinity", {"required": [REQUIREMENT] * (MAX_TERMS + 1)}),
    "affinity.preferred over its count": _set(
        "affinity", {"preferred": [{"weight": 1, "term": REQUIREMENT}] * (MAX_TERMS + 1)}
    ),
    "a required term a string": _set("affinity", {"required": ["zone"]}),
    "a required term with an unknown member": _affinity_required(matchExpressions=[]),
    "a required term key missing": _affinity_required(key=DROP),
    "a required term key not a label key": _affinity_required(key="-zone"),
    "a required term operator unknown": _affinity_required(operator="Within"),
    "a required term operator lower-case": _affinity_required(operator="in"),
    "a required term In without values": _affinity_required(values=DROP),
    "a required term In with values null": _affinity_required(values=None),
    "a required term values a string": _affinity_required(values="a"),
    "a required term values with a number": _affinity_required(values=[1]),
    "a required term values over their count": _affinity_required(values=["a"] * (MAX_TERM_VALUES + 1)),
    "a required term Exists with values": _affinity_required(operator="Exists"),
    "a required term Gt with two values": _affinity_required(operator="Gt", values=["1", "2"]),
    "a required term Gt not an integer": _affinity_required(operator="Gt", values=["1.5"]),
    "a required term Lt with 19 digits": _affinity_required(operator="Lt", values=["1" * 19]),
    "a preferred term a string": _set("affinity", {"preferred": ["zone"]}),
    "a preferred term without its term": _affinity_preferred(term=DROP),
    "a preferred term without its weight": _affinity_preferred(weight=DROP),
    "a preferred term weight 0": _affinity_preferred(weight=0),
    "a preferred term weight 101": _affinity_preferred(weight=101),
    "a preferred term weight a string": _affinity_preferred(weight="10"),
    "a preferred term with an unknown member": _affinity_preferred(preference={}),
    "a preferred term's term a string": _affinity_preferred(term="zone"),
    "a preferred term's term bad": _affinity_preferred(term={**REQUIREMENT, "operator": "Near"}),
    # tolerations
    "tolerations an object": _set("tolerations", TOLERATION),
    "tolerations over their count": _set("tolerations", [TOLERATION] * (MAX_TERMS + 1)),
    "a toleration a string": _set("tolerations", ["gpu"]),
    "a toleration with an unknown member": _item("tolerations", TOLERATION, tolerationSeconds=5),
    "a toleration key not a label key": _item("tolerations", TOLERATION, key="no spaces"),
    "a toleration key a number": _item("tolerations", TOLERATION, key=5),
    "a toleration key missing with Equal": _item("tolerations", TOLERATION, key=DROP),
    "a toleration key empty with Exists": _item("tolerations", TOLERATION, key="", operator="Exists", value=DROP),
    "a toleration operator unknown": _item("tolerations", TOLERATION, operator="Matches"),
    "a toleration operator empty": _item("tolerations", TOLERATION, operator=""),
    "a toleration operator null": _item("tolerations", TOLERATION, operator=None),
    "a toleration value a number": _item("tolerations", TOLERATION, value=1),
    "a toleration value with Exists": _item("tolerations", TOLERATION, operator="Exists"),
    "a toleration effect unknown": _item("tolerations", TOLERATION, effect="NoRun"),
    "a toleration effect a number": _item("tolerations", TOLERATION, effect=1),
    "a toleration's seconds negative": _item("tolerations", TOLERATION, toleration_seconds=-1),
    "a toleration's seconds at its limit": _item("tolerations", TOLERATION, toleration_seconds=MAX_TOLERATION_SECONDS),
    "a toleration's seconds over its limit": _item(
        "tolerations", TOLERATION, toleration_seconds=MAX_TOLERATION_SECONDS + 1
    ),
    "a toleration's seconds a float": _item("tolerations", TOLERATION, toleration_seconds=1.5),
    "a toleration's seconds a string": _item("tolerations", TOLERATION, toleration_seconds="60"),
    **{f"a toleration {member} {name}": _item("tolerations", TOLERATION, **{member: value})
       for member in ("key", "operator", "value", "effect") for name, value in FALSY.items() if value != ""},
    # spread
    "spread a string": _set("spread", "web"),
    "spread with an unknown member": _within("spread", SPREAD, max_skew=1),
    "spread.group missing": _within("spread", SPREAD, group=DROP),
    "spread.group empty": _within("spread", SPREAD, group=""),
    "spread.group at 200 characters": _within("spread", SPREAD, group="g" * 200),
    "spread.group over 200 characters": _within("spread", SPREAD, group="g" * 201),
    "spread.group a number": _within("spread", SPREAD, group=1),
    "spread.topology_key an alias": _within("spread", SPREAD, topology_key="rack"),
    "spread.topology_key not a label key": _within("spread", SPREAD, topology_key="no spaces"),
    "spread.topology_key empty": _within("spread", SPREAD, topology_key=""),
    "spread.mode unknown": _within("spread", SPREAD, mode="clump"),
    "spread.mode null": _within("spread", SPREAD, mode=None),
    **{f"spread.{member} {name}": _within("spread", SPREAD, **{member: value})
       for member in ("topology_key", "mode") for name, value in FALSY.items() if value != ""},
    # devices
    "devices an object": _set("devices", DEVICE),
    "devices over their count": _set("devices", [DEVICE] * (MAX_DEVICE_REQUESTS + 1)),
    "devices empty without resources": lambda body: body.update(devices=[], resources=None),
    "devices without resources": lambda body: body.update(devices=[DEVICE], resources=None),
    "devices an object without resources": lambda body: body.update(devices={}, resources=None),
    "a device request a string": _set("devices", ["nvidia.com/gpu"]),
    "a device request with an unknown member": _item("devices", DEVICE, model="H100"),
    "a device type missing": _item("devices", DEVICE, type=DROP),
    "a device type without a domain": _item("devices", DEVICE, type="gpu"),
    "a device type unknown": _item("devices", DEVICE, type="example.com/tpu"),
    "a device type over its limit": _item("devices", DEVICE, type="example.com/" + "t" * MAX_DEVICE_TYPE),
    "a device type a number": _item("devices", DEVICE, type=1),
    "a device count 0": _item("devices", DEVICE, count=0),
    "a device count over its limit": _item("devices", DEVICE, count=MAX_COUNT + 1),
    "a device count null": _item("devices", DEVICE, count=None),
    "a device count a string": _item("devices", DEVICE, count="1"),
    "device constraints an object": _item("devices", DEVICE, constraints=CONSTRAINT),
    "device constraints over their count": _item("devices", DEVICE, constraints=[CONSTRAINT] * (MAX_CONSTRAINTS + 1)),
    "a device colocate unknown": _item("devices", DEVICE, colocate="rack"),
    "a device colocate empty": _item("devices", DEVICE, colocate=""),
    "devices asking for what resources count otherwise": lambda body: body.update(
        resources={"nvidia.com/gpu": "1"}, devices=[{**DEVICE, "count": 2}]
    ),
    "devices asking for what resources count alike": lambda body: body.update(
        resources={"nvidia.com/gpu": "2"}, devices=[{**DEVICE, "count": 2}]
    ),
    "a device constraint a string": _item("devices", DEVICE, constraints=["memory>=40Gi"]),
    "a device constraint with an unknown member": _constraint(unit="Gi"),
    "a device constraint attribute unknown": _constraint(attribute="colour"),
    "a device constraint attribute a number": _constraint(attribute=1),
    "a device constraint attribute missing": _constraint(attribute=DROP),
    "a device constraint operator unknown": _constraint(operator="~"),
    "a device constraint operator missing": _constraint(operator=DROP),
    "a device constraint value missing": _constraint(value=DROP),
    "a device constraint value null": _constraint(value=None),
    "a device constraint value not a quantity": _constraint(value="lots"),
    "a device constraint value a boolean": _constraint(value=True),
    "a device constraint glob on a number": _constraint(operator="glob", value="4*"),
    "a device constraint > on text": _constraint(attribute="model", operator=">", value="A100"),
    "a device constraint glob empty": _constraint(attribute="model", operator="glob", value=""),
    "a device constraint glob at its limit": _constraint(attribute="model", operator="glob", value="*" * 200),
    "a device constraint glob over its limit": _constraint(attribute="model", operator="glob", value="*" * 201),
    "a device constraint text a number": _constraint(attribute="model", operator="=", value=100),
    "a device constraint text empty": _constraint(attribute="model", operator="=", value=""),
    "a device constraint text over its limit": _constraint(attribute="model", operator="=", value="m" * 201),
    # node constraints and preferences
    "node_constraints an object": _set("node_constraints", NODE_CONSTRAINT),
    "node_constraints over their count": _set("node_constraints", [NODE_CONSTRAINT] * (MAX_NODE_CONSTRAINTS + 1)),
    "a node constraint a string": _set("node_constraints", ["reliability>=0.99"]),
    "a node constraint with an unknown member": _item("node_constraints", NODE_CONSTRAINT, weight=5),
    "a node constraint attribute unknown": _item("node_constraints", NODE_CONSTRAINT, attribute="uptime"),
    "a node constraint attribute a list": _item("node_constraints", NODE_CONSTRAINT, attribute=["reliability"]),
    "a node preference attribute an object": _item("node_preferences", {**NODE_CONSTRAINT, "weight": 1},
                                                   attribute={}),
    "a node constraint attribute missing": _item("node_constraints", NODE_CONSTRAINT, attribute=DROP),
    "a node constraint operator unknown": _item("node_constraints", NODE_CONSTRAINT, operator="=>"),
    "a node constraint operator missing": _item("node_constraints", NODE_CONSTRAINT, operator=DROP),
    "a node constraint value over 1": _item("node_constraints", NODE_CONSTRAINT, value=1.01),
    "a node constraint value negative": _item("node_constraints", NODE_CONSTRAINT, value=-0.1),
    "a node constraint value a numeric string": _item("node_constraints", NODE_CONSTRAINT, value="0.9"),
    "a node constraint value in millis": _item("node_constraints", NODE_CONSTRAINT, value="990m"),
    "a node constraint value not a number": _item("node_constraints", NODE_CONSTRAINT, value="high"),
    "a node constraint value NaN": _item("node_constraints", NODE_CONSTRAINT, value="NaN"),
    "a node constraint value a boolean": _item("node_constraints", NODE_CONSTRAINT, value=True),
    "a node constraint value missing": _item("node_constraints", NODE_CONSTRAINT, value=DROP),
    "node_preferences over their count": _set(
        "node_preferences", [{**NODE_CONSTRAINT, "weight": 1}] * (MAX_NODE_CONSTRAINTS + 1)
    ),
    "a node preference without a weight": _item("node_preferences", {**NODE_CONSTRAINT, "weight": 1}, weight=DROP),
    "a node preference weight 0": _item("node_preferences", {**NODE_CONSTRAINT, "weight": 1}, weight=0),
    "a node preference weight a float": _item("node_preferences", {**NODE_CONSTRAINT, "weight": 1}, weight=1.0),
    "a node preference value over 1": _item("node_preferences", {**NODE_CONSTRAINT, "weight": 1}, value=2),
    "a node preference with an unknown member": _item("node_preferences", {**NODE_CONSTRAINT, "weight": 1}, w=1),
}  # fmt: skip


# Former faults of the hand validator in leases.device_requests, each kept as a case: a falsy
# constraints or colocate of the wrong type was read as absent, and a constraint's unhashable
# attribute raised TypeError (a 500).
FORMER_FAULTS = {
    **{f"device constraints {name}": _item("devices", DEVICE, constraints=value) for name, value in FALSY.items()
       if value != []},
    **{f"a device colocate {name}": _item("devices", DEVICE, colocate=value) for name, value in FALSY.items()
       if value != ""},
    "a device constraint attribute a list": _constraint(attribute=["memory"]),
}  # fmt: skip


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(bodies(), TARGETED))
def test_the_hand_validator_accepts_exactly_what_the_schema_serializer_accepts(case):
    agree(by_hand, by_schema, *case)


def test_every_targeted_mutation_is_judged_alike():
    """Each targeted mutation once, on the smallest valid body (hypothesis may not draw them all)."""
    failures = []
    for name, how in TARGETED.items():
        body = {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "1"}}
        if how is None:
            body = [body]
        else:
            how(body)
        try:
            agree(by_hand, by_schema, body, True)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", sorted(FORMER_FAULTS))
def test_the_former_faults_of_the_device_requests_are_judged_alike(name):
    body = {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "1"}}
    FORMER_FAULTS[name](body)
    agree(by_hand, by_schema, body, True)


def test_the_targeted_mutations_are_mostly_refused():
    """A guard on the test itself: the mutations are meant to break the body (a few show a valid edge)."""
    refused = 0
    for how in TARGETED.values():
        body = {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "1"}}
        if how is not None:
            how(body)
        refused += by_hand(body if how is not None else [body]) is not None
    assert refused >= 0.8 * len(TARGETED)


def test_a_refusal_names_one_field_and_the_serializer_error_shape_is_understood():
    with pytest.raises(ValidationError):
        LeaseCreateRequestSerializer(data={"workload_id": 1}).is_valid(raise_exception=True)
    assert by_schema({"workload_id": "w", "pool": "p", "tolerations": [{"key": 1}]}) == ["tolerations[0].key"]
