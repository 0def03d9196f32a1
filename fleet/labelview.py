"""The label set placement matches a node on, in one place for placement and for the node list.

Layers, weakest first: the node's identity (``kubernetes.io/hostname``, ``nodepool.dev/node-id``,
``nodepool.dev/pool``), its verified scalar features (``arch`` also as ``kubernetes.io/arch``,
``os`` as ``kubernetes.io/os``), its pool's labels, the labels the node declares about itself
only when its pool trusts node labels (``Pool.trust_node_labels``), then platform labels, which
win. ``leases.placement.node_label_view`` and the node list's ``label`` selector both read this,
so ``nodepoolctl get nodes -l zone=a`` lists the nodes a ``nodeSelector`` of ``zone: a`` can land on.
"""

from __future__ import annotations

from typing import Any

from .labels import HOSTNAME_LABEL

NODE_ID_LABEL, POOL_LABEL = "nodepool.dev/node-id", "nodepool.dev/pool"
FEATURE_LABELS = {"kubernetes.io/arch": "arch", "kubernetes.io/os": "os"}


def identity_labels(pk, hostname: str, pool_name: str) -> dict[str, str]:
    """The labels every node has from its identity, the weakest layer of :func:`label_view`."""
    return {HOSTNAME_LABEL: hostname or str(pk), NODE_ID_LABEL: str(pk), POOL_LABEL: pool_name}


def label_view(
    *,
    pk,
    hostname: str,
    pool_name: str,
    pool_labels: dict | None,
    trust_node_labels: bool,
    node_labels: dict | None,
    labels: dict | None,
    verified: dict | None,
) -> dict[str, str]:
    """The labels placement matches on (see the module's docstring), values as strings."""
    view = identity_labels(pk, hostname, pool_name)
    features: Any = (verified or {}).get("features") or {}
    for key, value in features.items():
        if isinstance(value, str | int | bool):
            view[key] = str(value)
    if "arch" in features:
        view["kubernetes.io/arch"] = str(features["arch"])
    if "os" in features:
        view["kubernetes.io/os"] = str(features["os"])
    view.update({k: str(v) for k, v in (pool_labels or {}).items()})
    if trust_node_labels:
        view.update({k: str(v) for k, v in (node_labels or {}).items()})
    view.update({k: str(v) for k, v in (labels or {}).items()})
    return view
