"""A pool's target (what its nodes must run) and the admission check that verifies it.

A node is upgraded only when admission verifies the target after its restart: the check
``upgrade_target`` (registered with :func:`fleet.admission.register_check`) compares the
version the agent reports in its heartbeats and what it declared with the pool's target.
"""

from __future__ import annotations

import re
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from fleet.admission import Outcome, failed, passed, skipped
from fleet.models import Node, Pool
from nodepool.api.problems import Problem

from .errors import INVALID_TARGET
from .models import PoolOperations

CHECK_NAME = "upgrade_target"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
ACTION = re.compile(r"^[a-z][a-z0-9_.-]{0,62}$")
TARGET_KEYS = {"version", "agent_versions", "image", "kernel", "driver", "labels", "artifact", "action"}
# What the node reports or declares (features, else labels) and must equal when the target names it.
DECLARED = ("image", "kernel", "driver")


def _bad(field: str, message: str) -> Problem:
    return Problem(
        f"target.{field}: {message}", INVALID_TARGET, errors=[{"field": f"target.{field}", "message": message}]
    )


def parse_target(value: Any) -> dict:
    """Validate a target from the wire; returns it normalised.

    Shape: ``{"version": PEP 440 (required), "agent_versions": PEP 440 specifier set (default
    ``==version``), "image": str, "kernel": str, "driver": str (e.g. the GPU driver), "labels":
    {str: str}, "artifact": {"ref": str, "sha256": 64 lowercase hex}, "action": name of the
    agent's upgrade action (default "agent")}``.

    Raises: Problem (400 ``invalid_target``).
    """
    if not isinstance(value, dict) or not value:
        raise _bad("", "must be a non-empty object")
    unknown = set(value) - TARGET_KEYS
    if unknown:
        raise _bad(sorted(unknown)[0], "unknown member")
    version = value.get("version")
    try:
        Version(str(version))
    except InvalidVersion:
        raise _bad("version", "required: a PEP 440 version such as 2.0.0") from None
    if not isinstance(version, str) or len(version) > 64:
        raise _bad("version", "must be a string of at most 64 characters")
    spec = value.get("agent_versions") or f"=={version}"
    try:
        specifiers = SpecifierSet(spec)
    except (InvalidSpecifier, TypeError):
        raise _bad("agent_versions", "must be a PEP 440 specifier set such as '>=2.0,<3'") from None
    if not specifiers.contains(Version(version), prereleases=True):
        raise _bad("agent_versions", f"does not contain the target version {version}")
    for name in DECLARED:
        if not isinstance(value.get(name, ""), str) or len(value.get(name, "")) > 200:
            raise _bad(name, "must be a string of at most 200 characters")
    labels = value.get("labels", {})
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise _bad("labels", "must be an object of strings")
    artifact = value.get("artifact", {})
    if not isinstance(artifact, dict) or set(artifact) - {"ref", "sha256"}:
        raise _bad("artifact", "must be {ref, sha256}")
    if artifact and (not isinstance(artifact.get("ref"), str) or not artifact["ref"] or len(artifact["ref"]) > 500):
        raise _bad("artifact.ref", "required with an artifact: a string of at most 500 characters")
    if artifact and not (isinstance(artifact.get("sha256"), str) and SHA256.fullmatch(artifact["sha256"])):
        raise _bad("artifact.sha256", "must be 64 lowercase hexadecimal characters")
    action = value.get("action", "agent")
    if not isinstance(action, str) or not ACTION.fullmatch(action):
        raise _bad("action", "must be a short lowercase name such as 'agent'")
    return {
        "version": version,
        "agent_versions": str(specifiers) or f"=={version}",
        "image": value.get("image", ""),
        "kernel": value.get("kernel", ""),
        **({"driver": value["driver"]} if value.get("driver") else {}),
        "labels": dict(labels),
        "artifact": dict(artifact),
        "action": action,
    }


def target_mismatches(node: Node, target: dict) -> list[str]:
    """What keeps ``node`` from matching ``target`` (empty: it matches)."""
    problems = []
    try:
        version = Version(node.agent_version)
    except InvalidVersion:
        return [f"agent version {node.agent_version!r} is not a PEP 440 version"]
    spec = target.get("agent_versions") or f"=={target.get('version')}"
    if not SpecifierSet(spec).contains(version, prereleases=True):
        problems.append(f"agent version {version} is outside the target {spec}")
    features = (node.declared or {}).get("features") or {}
    labels = {**(node.node_labels or {}), **(node.labels or {})}
    for name in DECLARED:
        want = target.get(name)
        have = features.get(name) or labels.get(name, "")
        if want and have != want:
            problems.append(f"{name} {have!r} is not the target {want!r}")
    for key, want in (target.get("labels") or {}).items():
        if labels.get(key) != want:
            problems.append(f"label {key}={labels.get(key)!r}, target {want!r}")
    return problems


def pool_target(pool: Pool) -> dict:

    return PoolOperations.objects.filter(pool=pool).values_list("target", flat=True).first() or {}


def check_upgrade_target(node: Node, pool: Pool) -> Outcome:
    """Admission check: the node matches its pool's target (skipped when the pool has none)."""
    target = pool_target(pool)
    if not target:
        return skipped("the pool has no upgrade target")
    problems = target_mismatches(node, target)
    if problems:
        return failed("not at the pool's target: " + "; ".join(problems), problems=problems)
    return passed(f"at the pool's target {target.get('version')}")
