"""Which label keys a node may set on itself: Kubernetes' NodeRestriction, plus nodepool's own prefix.

Borrowed rule (kubernetes/kubernetes, ``plugin/pkg/admission/noderestriction`` and
``pkg/kubelet/apis/well_known_labels.go`` ``IsKubeletLabel``): a kubelet may set a label in the
``kubernetes.io`` or ``k8s.io`` domains (or their subdomains) only when it is on the kubelet's
allow-list — hostname, arch, os, instance type, topology region and zone, and anything under the
``kubelet.kubernetes.io/`` and ``node.kubernetes.io/`` namespaces. ``node-restriction.kubernetes.io/``
exists precisely so that operators can label nodes in a way no node can forge. nodepool adds its
own prefix ``nodepool.dev/`` (placement matches ``nodepool.dev/node-id`` and ``nodepool.dev/pool``).

These keys stay settable by operators (platform labels) and the Kubernetes importer; only labels a
node declares about itself (enrollment) are checked here. Labels a node sets, topology included,
are used for placement only when its pool trusts node labels (``Pool.trust_node_labels``).
"""

from __future__ import annotations

HOSTNAME_LABEL = "kubernetes.io/hostname"
PROJECT_DOMAIN = "nodepool.dev"
RESTRICTED_DOMAINS = ("kubernetes.io", "k8s.io", PROJECT_DOMAIN)
KUBELET_LABELS = frozenset(
    {
        HOSTNAME_LABEL,
        "kubernetes.io/arch",
        "kubernetes.io/os",
        "beta.kubernetes.io/arch",
        "beta.kubernetes.io/os",
        "beta.kubernetes.io/instance-type",
        "node.kubernetes.io/instance-type",
        "topology.kubernetes.io/region",
        "topology.kubernetes.io/zone",
        "failure-domain.beta.kubernetes.io/region",
        "failure-domain.beta.kubernetes.io/zone",
    }
)
KUBELET_NAMESPACES = ("kubelet.kubernetes.io", "node.kubernetes.io")
NODE_RESTRICTION_NAMESPACE = "node-restriction.kubernetes.io"


def _in_domain(namespace: str, domain: str) -> bool:
    return namespace == domain or namespace.endswith("." + domain)


def node_may_set(key: str) -> bool:
    """True when a node may declare label ``key`` about itself (NodeRestriction's rule).

    Args:
        key: a syntactically valid label key (``prefix/name`` or ``name``).
    """
    namespace = key.rpartition("/")[0].lower()
    if not namespace:
        return True
    if _in_domain(namespace, NODE_RESTRICTION_NAMESPACE) or _in_domain(namespace, PROJECT_DOMAIN):
        return False
    if not any(_in_domain(namespace, domain) for domain in ("kubernetes.io", "k8s.io")):
        return True
    return key in KUBELET_LABELS or any(_in_domain(namespace, allowed) for allowed in KUBELET_NAMESPACES)


def reserved_label_errors(labels: dict[str, str], *, hostname: str) -> list[dict[str, str]]:
    """The labels of ``labels`` a node may not set, as problem ``errors`` members (empty when none).

    Args:
        labels: the node's declared labels (already valid Kubernetes label syntax).
        hostname: the hostname the node enrolls with; ``kubernetes.io/hostname`` must equal it.
    """
    errors = []
    for key, value in labels.items():
        if not node_may_set(key):
            errors.append(
                {"field": f"labels.{key}", "code": "reserved_label", "message": "a node may not set this label key"}
            )
        elif key == HOSTNAME_LABEL and value != hostname:
            errors.append(
                {
                    "field": f"labels.{key}",
                    "code": "reserved_label",
                    "message": f"must equal the node's hostname ({hostname!r})",
                }
            )
    return errors
