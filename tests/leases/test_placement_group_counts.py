"""A spread group's leases per topology domain (``placement.group_counts``) are one grouped query
that reads, on PostgreSQL, only the topology keys' values out of the nodes' JSON documents. It must
count exactly what the label view of each lease's whole node says (``node_label_view``), whatever
layer names the key: the node's identity, a verified feature (``arch`` → ``kubernetes.io/arch``),
pool labels, declared labels in a pool that trusts them, or platform labels, which win.
"""

from __future__ import annotations

from collections import Counter

import pytest

from fleet.models import Node
from leases import placement
from leases.choices import LIVE_LEASE_STATES
from leases.models import Lease
from leases.spec import parse_spec
from tests.factories import PoolFactory, make_schedulable_node
from tests.maintenance_support import make_lease

pytestmark = pytest.mark.django_db

TOPOLOGY_KEYS = ["host", "zone", "rack", "kubernetes.io/arch", "nodepool.dev/pool", "nodepool.dev/node-id", "gpu", "7"]


def _reference(spec) -> Counter:
    """The former implementation: every live lease of the group, its node's whole label view."""
    counts: Counter = Counter()
    for lease in Lease.objects.filter(group=spec.spread_group, state__in=LIVE_LEASE_STATES).select_related(
        "node__pool"
    ):
        domain = placement.topology_domain(placement.node_label_view(lease.node, lease.node.pool), spec)
        if domain is not None:
            counts[domain] += 1
    return counts


@pytest.fixture
def fleet():
    trusting = PoolFactory(name="trusting", trust_node_labels=True, labels={"rack": "pool-rack"})
    plain = PoolFactory(name="plain", labels={})
    nodes = [
        make_schedulable_node(plain)[0],  # identity only
        make_schedulable_node(plain)[0],
        make_schedulable_node(plain, labels={"kubernetes.io/hostname": "renamed", "zone": "a", "7": "r1"})[0],
        make_schedulable_node(plain, labels={"topology.kubernetes.io/zone": "b"})[0],
        make_schedulable_node(trusting)[0],  # pool label
        make_schedulable_node(trusting, labels={"rack": "platform-rack", "7": "r2"})[0],  # platform beats pool
        make_schedulable_node(trusting)[0],
        make_schedulable_node(plain)[0],
    ]
    Node.objects.filter(pk=nodes[1].pk).update(hostname="")  # identity falls back to the node id
    Node.objects.filter(pk=nodes[6].pk).update(node_labels={"zone": "declared", "rack": "declared-rack"})
    Node.objects.filter(pk=nodes[7].pk).update(
        node_labels={"zone": "ignored"},  # the plain pool does not trust declared labels
        verified={"features": {"arch": "arm64", "gpu": True, "zone": 3}},  # scalars become labels as str()
    )
    Node.objects.filter(pk=nodes[0].pk).update(verified={"features": {"gpu": "true", "rack": {"not": "scalar"}}})
    for index, node in enumerate(nodes):
        make_lease(node, f"w-{index}", group="g", resources={})
    make_lease(nodes[0], "w-extra", group="g", resources={})  # two leases in one domain
    make_lease(nodes[2], "w-other-group", group="other", resources={})
    return nodes


@pytest.mark.parametrize("topology_key", TOPOLOGY_KEYS)
def test_group_counts_match_the_whole_label_view_of_every_leased_node(fleet, topology_key):
    spec = parse_spec(
        {"workload_id": "w", "pool": "plain", "resources": {"cpu": "1"},
         "spread": {"group": "g", "topology_key": topology_key, "mode": "anti-affinity"}}
    )  # fmt: skip
    counts = placement.group_counts(spec, fleet[0].pool)
    assert counts.by_domain == _reference(spec)
    assert sum(counts.by_domain.values()) <= 9
    if topology_key == "7":  # a key Django's JSON transforms would read as an array index
        assert counts.by_domain == {"r1": 1, "r2": 1}


def test_a_host_wide_group_is_read_in_one_query(fleet, django_assert_num_queries):
    spec = parse_spec(
        {"workload_id": "w", "pool": "plain", "resources": {"cpu": "1"},
         "spread": {"group": "g", "topology_key": "host", "mode": "anti-affinity"}}
    )  # fmt: skip
    with django_assert_num_queries(1):
        counts = placement.group_counts(spec, fleet[0].pool)
    assert counts.by_domain["renamed"] == 1 and counts.by_domain[str(fleet[1].pk)] == 1
    assert counts.by_domain[fleet[0].hostname] == 2


def test_an_excluded_lease_is_not_counted(fleet):
    spec = parse_spec(
        {"workload_id": "w", "pool": "plain", "resources": {"cpu": "1"},
         "spread": {"group": "g", "topology_key": "host", "mode": "anti-affinity"}}
    )  # fmt: skip
    extra = Lease.objects.get(workload_id="w-extra")
    assert placement.group_counts(spec, fleet[0].pool, exclude_lease_id=extra.pk).by_domain[fleet[0].hostname] == 1
