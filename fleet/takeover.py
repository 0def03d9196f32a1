"""Bootstrap tokens that name a node: an agent takes an existing node over, keeping its identity.

Three situations end with a node that has no usable credential although the machine is still the
same node: a node imported from Kubernetes (fleet.k8s_import) has never had an agent; a node
partitioned for longer than its credential's lifetime gets 401 ``credential_expired`` forever; a
node whose lineage was revoked (quarantine, reuse detection) and then released has none left.
Enrolling again with an ordinary token would create a *new* node and orphan the old one (its
leases, devices, events and history).

The rule, after the kubelet's certificate bootstrap (a kubelet whose client certificate expired
falls back to its bootstrap credential and asks for a new certificate *for the same node name*):
an operator creates a bootstrap token naming the node (``POST /bootstrap-tokens {"node": id}``;
the admin's "Allow an agent to take over" action). ``POST /node-enrollments`` with that token
does not create a node: it re-enrolls the named one. Its id, pool, owner, lifecycle, labels,
taints, leases and devices stay; its whole credential lineage is revoked and one new credential
issued; the node moves to a new incarnation (one above its last, sequence restarted), which the
agent takes from the answer: whoever still holds the old session's messages is answered
``stale_incarnation`` (fenced), as after any restart. Devices reported by the
agent are the same node's (the handover rule of docs/fleet.md, "Devices"), never a conflict.

Such a token is used once (the conditional spend of fleet.services.bootstrap_token_use, so of two
agents racing with it exactly one wins). A token naming a node never enrolls a new node, and an
agent that sends its own node id (``"node"`` in the body) is refused unless the token names that
very node (403 ``bootstrap_token_wrong_node``).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from nodepool.api.problems import Conflict, Gone, Problem

from . import event_types
from .choices import Lifecycle
from .credentials import issue_credential, revoke_all_credentials
from .errors import INVALID_MAX_USES, NODE_POOL_MISMATCH, NODE_QUARANTINED, NODE_RETIRED, UNKNOWN_NODE
from .events import Actor, record_event
from .models import BootstrapToken, Node, NodeCredential, Pool

# Lifecycles whose declared capability an agent taking over may replace: admission has not
# verified (or must verify again) what the node is. Elsewhere the node's capability is already
# verified, and a node never raises its own capacity (DESIGN.md, node credentials).
REDECLARE_IN = (Lifecycle.PENDING, Lifecycle.REJECTED)


def token_node(*, node_id: Any, pool: Pool | None) -> tuple[Node, Pool]:
    """The node a new token will name, and its pool, for ``bootstrap_token_create(node=…)``.

    Args:
        node_id: the node's id (a UUID or its string) as the operator sent it.
        pool: the pool the operator also named, or None (then the node's pool).

    Raises:
        Problem: 400 ``unknown_node`` (no such node, or not a UUID), 400 ``node_pool_mismatch``
            (``pool`` is not the node's pool).
        Gone: 410 ``node_retired``.
        Conflict: 409 ``node_quarantined`` (release it first: a quarantined node gets no credential).
    """
    try:
        key = uuid.UUID(str(node_id))
    except ValueError:
        key = None
    node = Node.objects.select_related("pool").filter(pk=key).first() if key else None
    if node is None:
        raise Problem(f"No node {node_id!s:.64}.", UNKNOWN_NODE)
    if pool is not None and pool.pk != node.pool_id:
        raise Problem(
            f"Node {node.pk} is in pool {node.pool.name!r}, not {pool.name!r}; a token naming it belongs to its pool.",
            NODE_POOL_MISMATCH,
        )
    refuse_lifecycle(node)
    return node, node.pool


def check_max_uses(max_uses: int) -> None:
    """A token naming a node is used once; raises 400 ``invalid_max_uses`` otherwise."""
    if max_uses != 1:
        raise Problem("A bootstrap token naming a node is used once: max_uses must be 1.", INVALID_MAX_USES)


def refuse_lifecycle(node: Node) -> None:
    """410 ``node_retired`` for a retired node, 409 ``node_quarantined`` for a quarantined one."""
    if node.lifecycle == Lifecycle.RETIRED:
        raise Gone("This node is retired; no agent can take it over.", NODE_RETIRED)
    if node.lifecycle == Lifecycle.QUARANTINED:
        raise Conflict(
            "This node is quarantined; release it first (POST /nodes/{id}/release).",
            NODE_QUARANTINED,
            lifecycle=node.lifecycle,
        )


def take_over(
    *,
    node: Node,
    token: BootstrapToken,
    hostname: str,
    display_name: str,
    addresses: list[str],
    agent_version: str,
    labels: dict[str, str],
    capability: dict[str, Any],
    actor: Actor,
    now: datetime,
    attestation: dict[str, str] | None = None,
) -> tuple[NodeCredential, str]:
    """Re-enroll ``node`` (locked by the caller, inside the token's spend transaction) for a new agent.

    Revokes every credential of the node, issues one (issuer ``enrollment``), starts a new
    incarnation (``incarnation + 1``, ``sequence`` -1: the agent's first message is sequence 1),
    records the enrollment evidence (token, time, agent version) and one ``taken_over`` event. The declared
    capability, hostname, addresses and node labels are replaced only while the node is
    ``pending`` or ``rejected`` (:data:`REDECLARE_IN`), and so is the attestation document
    (``{"document", "signature"}``, checked by admission like an enrollment's); a node already
    admitted keeps what was verified. ``display_name`` is replaced when sent (an imported node
    keeps its Kubernetes name).

    Returns ``(credential, secret)``. Raises as :func:`refuse_lifecycle` (the caller's transaction
    then rolls the spend back).
    """
    refuse_lifecycle(node)
    revoked = revoke_all_credentials(node=node, now=now)
    fields = ["agent_version", "enrolled_agent_version", "enrolled_at", "bootstrap_token", "incarnation", "sequence",
              "version", "updated_at"]  # fmt: skip
    node.incarnation, node.sequence = node.incarnation + 1, -1
    node.agent_version = node.enrolled_agent_version = agent_version
    node.enrolled_at, node.bootstrap_token = now, token
    redeclared = node.lifecycle in REDECLARE_IN
    if redeclared:
        node.hostname, node.addresses, node.node_labels, node.declared = hostname, addresses, labels, capability
        node.attestation = attestation or {}
        fields += ["hostname", "addresses", "node_labels", "declared", "attestation"]
    if display_name:
        node.display_name = display_name
        fields.append("display_name")
    node.version += 1
    node.save(update_fields=fields)
    credential, secret = issue_credential(node=node, issuer="enrollment", agent_version=agent_version, now=now)
    record_event(
        node,
        event_types.TAKEN_OVER,
        actor,
        reason=f"an agent took the node over with bootstrap token {token.prefix} naming it",
        data={
            "hostname": hostname,
            "agent_version": agent_version,
            "credential": credential.prefix,
            "credentials_revoked": revoked,
            "capability_redeclared": redeclared,
            "external_id": node.external_id,
            "incarnation": node.incarnation,
        },
    )
    return credential, secret
