"""Admission: named checks, the benchmark request, and the final ready/rejected decision (the
benchmark's completion and expiry are in :mod:`fleet.benchmarks`).

:func:`run_admission` is what the Celery task ``fleet.run_admission`` calls. It is idempotent and
safe to run twice at once:

* each check's outcome is written with a compare-and-swap built from the model's transition
  (``nodepool.fsm.move``: ``status IN <sources>`` → its target), so a second run computing the
  same pure check writes nothing and records no second event;
* the benchmark is requested by whichever run claims the check (``started_at IS NULL`` → now);
* the final transition locks the node and re-reads lifecycle and attempt, so only one run moves it.

A crash midway leaves the node ``admitting`` with the checks written so far; the next run (a
Celery retry, or the ``fleet.resume_stalled_admissions`` sweep) does only what is left.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from cryptography.exceptions import InvalidSignature
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from nodepool import failsafe, fsm, metrics
from nodepool.celery import app as celery_app

from . import event_types, trust
from .capability import CapabilityError, implausible_values
from .choices import BenchmarkStatus, CheckStatus, Lifecycle
from .devices import sync_counts as sync_device_counts
from .devices import verify_node_devices
from .events import Actor, record_event
from .instructions import Instruction, post_instructions
from .models import OUTCOME_TRANSITIONS, AdmissionCheck, Benchmark, Node, Pool
from .policy import load_attestation_key
from .pools import node_inventory_set

AGENT_VERSION = "agent_version"
CAPABILITIES = "capabilities"
LABELS = "labels"
PLAUSIBILITY = "plausibility"
ATTESTATION = "attestation"
BENCHMARK = "benchmark"
BENCHMARKED_RESOURCES = ("cpu", "memory")
STALLED_AFTER = timedelta(minutes=10)


@dataclass
class Outcome:
    status: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


def passed(detail: str, **data) -> Outcome:
    return Outcome(CheckStatus.PASSED, detail, data)


def failed(detail: str, **data) -> Outcome:
    return Outcome(CheckStatus.FAILED, detail, data)


def skipped(detail: str) -> Outcome:
    return Outcome(CheckStatus.SKIPPED, detail)


# --- the checks: pure functions of the node and its pool -----------------------------------------


# The failed agent_version check's ``data.code`` when no agent ever enrolled on the node (an
# imported Kubernetes node, fleet.k8s_import): what is missing, not a version-string complaint.
AGENT_MISSING = "agent_missing"


def check_agent_version(node: Node, pool: Pool) -> Outcome:
    """The agent version must satisfy the pool's PEP 440 specifier set (pre-releases included).

    A node no agent has enrolled on (imported, ``agent_version`` empty) fails with
    ``data.code = "agent_missing"`` and says how an agent takes it over (fleet.takeover).
    """
    if not node.agent_version:
        return failed(
            "no agent runs on this node (it was imported, not enrolled): create a bootstrap token naming it "
            f'(POST /bootstrap-tokens {{"node": "{node.pk}"}}) and start nodepool-agent with that token, '
            "then release the rejected node and admit it again",
            code=AGENT_MISSING,
        )
    try:
        version = Version(node.agent_version)
    except InvalidVersion:
        return failed(f"agent version {node.agent_version!r} is not a PEP 440 version")
    if not pool.allowed_agent_versions:
        return passed(f"agent version {version} (the pool allows any)")
    if SpecifierSet(pool.allowed_agent_versions).contains(version, prereleases=True):
        return passed(f"agent version {version} satisfies {pool.allowed_agent_versions}")
    return failed(f"agent version {version} is outside the allowed {pool.allowed_agent_versions}")


def _feature_ok(have: Any, want: Any) -> bool:
    if isinstance(want, list):
        return isinstance(have, list) and all(item in have for item in want)
    if isinstance(have, list):
        return want in have
    return have == want


def check_capabilities(node: Node, pool: Pool) -> Outcome:
    """Declared resources at least the pool's minimums; declared features equal (or include) the required."""
    required = pool.required_capabilities or {}
    declared = node.declared or {}
    missing = []
    for name, minimum in (required.get("resources") or {}).items():
        have = (declared.get("resources") or {}).get(name, 0)
        if have < minimum:
            missing.append(f"{name} {have} < required {minimum}")
    for key, want in (required.get("features") or {}).items():
        have = (declared.get("features") or {}).get(key)
        if not _feature_ok(have, want):
            missing.append(f"feature {key}={have!r}, required {want!r}")
    if missing:
        return failed("missing required capabilities: " + "; ".join(missing), missing=missing)
    return passed("required capabilities present" if required else "the pool requires no capabilities")


def check_labels(node: Node, pool: Pool) -> Outcome:
    """Required labels present on the node (platform labels, or node-declared ones); ``"*"`` = any value."""
    labels = {**(node.node_labels or {}), **(node.labels or {})}
    missing = []
    for key, want in (pool.required_labels or {}).items():
        if key not in labels:
            missing.append(f"{key} is missing")
        elif want != "*" and labels[key] != want:
            missing.append(f"{key}={labels[key]!r}, required {want!r}")
    if missing:
        return failed("missing required labels: " + "; ".join(missing), missing=missing)
    return passed("required labels present" if pool.required_labels else "the pool requires no labels")


def check_plausibility(node: Node, pool: Pool) -> Outcome:
    """No impossible declared values (see :func:`fleet.capability.implausible_values`)."""
    problems = implausible_values(node.declared or {})
    if problems:
        return failed("implausible declared capability: " + "; ".join(problems), problems=problems)
    return passed("declared capability is plausible")


def _b64(value: Any) -> bytes:
    if not isinstance(value, str):
        raise ValueError("not a string")
    return base64.b64decode(value, validate=True)


def check_attestation(node: Node, pool: Pool) -> Outcome:
    """Ed25519 signature over the attestation document, verified with the pool's trusted key.

    The document (base64 of a JSON object) may bind itself to the node with ``hostname`` and to
    the pool with ``pool``; either, when present, must match, so a document signed for one
    machine or pool cannot be replayed by another.
    """
    evidence = node.attestation or {}
    if not evidence:
        if pool.attestation_required:
            return failed("the pool requires attestation and the node sent none")
        return skipped("no attestation sent and the pool does not require one")
    if not pool.attestation_public_key:
        return skipped("the pool has no trusted attestation key")
    try:
        key = load_attestation_key(pool.attestation_public_key)
        document, signature = _b64(evidence.get("document")), _b64(evidence.get("signature"))
    except CapabilityError as exc:
        return failed(f"the pool's attestation key is unusable: {exc.message}")
    except (ValueError, binascii.Error):
        return failed("the attestation document or signature is not base64")
    try:
        key.verify(signature, document)
    except InvalidSignature:
        return failed("the attestation signature does not verify against the pool's trusted key")
    try:
        claims = json.loads(document)
    except ValueError:
        return failed("the attestation document is not JSON")
    if not isinstance(claims, dict):
        return failed("the attestation document is not a JSON object")
    if "hostname" in claims and claims["hostname"] != node.hostname:
        return failed(f"the attestation names host {claims['hostname']!r}, not {node.hostname!r}")
    if "pool" in claims and claims["pool"] != pool.name:
        return failed(f"the attestation names pool {claims['pool']!r}, not {pool.name!r}")
    return passed("attestation signature verified with the pool's trusted key")


QUICK_CHECKS: list[tuple[str, Callable[[Node, Pool], Outcome]]] = [
    (AGENT_VERSION, check_agent_version),
    (CAPABILITIES, check_capabilities),
    (LABELS, check_labels),
    (PLAUSIBILITY, check_plausibility),
    (ATTESTATION, check_attestation),
]


# Checks contributed by higher apps, registered from their ``AppConfig.ready()`` (fleet never imports
# them: docs/foundation.md, "Which way dependencies point"). The operations app adds ``upgrade_target``.
# Each entry: (name, check function, applies(pool) -> bool or None for "always").
EXTRA_CHECKS: list[tuple[str, Callable[[Node, Pool], Outcome], Callable[[Pool], bool] | None]] = []


def register_check(
    name: str, function: Callable[[Node, Pool], Outcome], *, applies: Callable[[Pool], bool] | None = None
) -> None:
    """Add a quick admission check ``function(node, pool) -> Outcome`` run after the built-in ones,
    in pools where ``applies(pool)`` (default: every pool).

    Idempotent by name (``ready()`` may run twice in tests). The function must be pure: admission
    may run it twice (see the module docstring).
    """
    if all(existing != name for existing, _, _ in EXTRA_CHECKS):
        EXTRA_CHECKS.append((name, function, applies))


def all_quick_checks() -> list[tuple[str, Callable[[Node, Pool], Outcome]]]:
    return [*QUICK_CHECKS, *((name, function) for name, function, _ in EXTRA_CHECKS)]


def check_names(pool: Pool) -> list[str]:
    """The checks an admission in ``pool`` runs, in order."""
    names = [name for name, _ in QUICK_CHECKS]
    names += [name for name, _, applies in EXTRA_CHECKS if applies is None or applies(pool)]
    return [*names, BENCHMARK] if pool.benchmark_required else names


# --- running -----------------------------------------------------------------------------------------


def record_outcome(check: AdmissionCheck, outcome: Outcome, actor: Actor, *, started_at, now) -> bool:
    """Write ``outcome`` if the check is still pending (compare-and-swap); one event if it wrote."""
    with transaction.atomic():
        wrote = fsm.move(
            AdmissionCheck.objects.filter(pk=check.pk),
            OUTCOME_TRANSITIONS[outcome.status],
            detail=outcome.detail,
            data={**(check.data or {}), **outcome.data},
            started_at=F("started_at") if check.started_at else started_at,
            finished_at=now,
        )
        if not wrote:
            return False
        if check.name == ATTESTATION and outcome.status != CheckStatus.SKIPPED:
            Node.objects.filter(pk=check.node_id).update(
                attestation_verified=outcome.status == CheckStatus.PASSED, attestation_detail=outcome.detail
            )
        record_event(
            check.node_id,
            event_types.ADMISSION_CHECK,
            actor,
            to_state=outcome.status,
            reason=f"{check.name}: {outcome.detail}",
            data={"check": check.name, "attempt": check.attempt, "status": outcome.status},
        )
    return True


def _request_benchmark(node: Node, check: AdmissionCheck, actor: Actor, now: datetime) -> None:
    """Ask the node for a benchmark (delivered in its heartbeat response) — exactly once per attempt."""
    with transaction.atomic():
        claimed = AdmissionCheck.objects.filter(
            pk=check.pk, status=CheckStatus.PENDING, started_at__isnull=True
        ).update(started_at=now)
        if not claimed:
            return
        deadline = now + timedelta(seconds=node.pool.benchmark_timeout)
        bench = Benchmark.objects.create(
            node=node, nonce=secrets.token_urlsafe(24), requested_at=now, deadline=deadline
        )
        post_instructions([node.pk], Instruction.BENCHMARK)
        AdmissionCheck.objects.filter(pk=check.pk).update(
            detail="waiting for the node's benchmark", data={"nonce": bench.nonce, "deadline": deadline.isoformat()}
        )
        record_event(
            node,
            event_types.BENCHMARK,
            actor,
            to_state=BenchmarkStatus.REQUESTED,
            reason=f"benchmark requested, due by {deadline.isoformat()}",
            data={"nonce": bench.nonce, "attempt": check.attempt},
        )


def run_admission(*, node_id, attempt: int, actor: Actor, now: datetime | None = None) -> str:
    """Run (or resume) admission attempt ``attempt`` of a node.

    Returns what happened: ``"stale"`` (the node is no longer admitting in this attempt),
    ``"waiting_benchmark"``, ``"ready"`` or ``"rejected"``.
    """
    node = Node.objects.select_related("pool").filter(pk=node_id).first()
    if node is None or node.lifecycle != Lifecycle.ADMITTING or node.admission_attempt != attempt:
        return "stale"
    pool = node.pool
    AdmissionCheck.objects.bulk_create(
        [AdmissionCheck(node=node, attempt=attempt, name=name) for name in check_names(pool)], ignore_conflicts=True
    )
    checks = {c.name: c for c in AdmissionCheck.objects.filter(node=node, attempt=attempt)}
    for name, function in all_quick_checks():
        check = checks.get(name)
        if check is None or check.status != CheckStatus.PENDING:
            continue
        started = timezone.now()
        outcome = function(node, pool)
        record_outcome(check, outcome, actor, started_at=started, now=now or timezone.now())
    checks = {c.name: c for c in AdmissionCheck.objects.filter(node=node, attempt=attempt)}
    any_failed = any(c.status == CheckStatus.FAILED for c in checks.values())
    bench = checks.get(BENCHMARK)
    if not any_failed and bench is not None and bench.status == CheckStatus.PENDING:
        _request_benchmark(node, bench, actor, now or timezone.now())
        return "waiting_benchmark"
    return finalize_admission(node_id=node.pk, attempt=attempt, actor=actor, now=now)


def finalize_admission(*, node_id, attempt: int, actor: Actor, now: datetime | None = None) -> str:
    """``admitting → ready`` when every check passed (or was skipped), ``→ rejected`` when any failed.

    Ready: ``verified`` becomes the declared capability that passed, and the inventory
    (capacity from verified, reserved from the pool, allocatable = capacity − reserved) is set.
    Rejected: pending checks are skipped and the reason lists every failed check.
    """
    now = now or timezone.now()
    with transaction.atomic():
        # The node row alone. Joined (select_related), its pool row was locked too: the pool's
        # node actions waited for each other, and pool_update (pool, then its nodes) deadlocked
        # with this. Nor joined unlocked (of=self): after waiting for the node, PostgreSQL returns
        # the joined row as it first read it. node.pool is read after the lock, by its own query:
        # a change of the pool's reservations locks every member node before it recomputes their
        # inventories, so this sees that change committed or has its inventory recomputed by it.
        node = Node.objects.select_for_update(no_key=True).filter(pk=node_id).first()
        if node is None or node.lifecycle != Lifecycle.ADMITTING or node.admission_attempt != attempt:
            return "stale"
        checks = list(AdmissionCheck.objects.filter(node=node, attempt=attempt))
        failures = [c for c in checks if c.status == CheckStatus.FAILED]
        before, lifted = node.lifecycle, False
        if failures:
            fsm.move(
                AdmissionCheck.objects.filter(node=node, attempt=attempt),
                "skip",
                detail="not run: another check failed",
                finished_at=now,
            )
            node.reject()
            node.lifecycle_reason = "admission failed: " + "; ".join(f"{c.name}: {c.detail}" for c in failures)
            data = {"attempt": attempt, "failed_checks": [{"name": c.name, "detail": c.detail} for c in failures]}
        else:
            if any(c.status == CheckStatus.PENDING for c in checks) or not checks:
                return "waiting"
            declared = node.declared or {}
            node.verified = {
                "resources": dict(declared.get("resources") or {}),
                "accelerators": list(declared.get("accelerators") or []),
                "features": dict(declared.get("features") or {}),
            }
            node_inventory_set(node=node, resources=node.verified["resources"])
            # Devices present now are verified (fleet.devices); their count replaces the declared one.
            verify_node_devices(node=node, actor=actor, now=now)
            # Verified anew: a mark left by a failed re-verification before the node went out of service goes.
            lifted = trust.clear_unverified(node, message="verified again by admission", now=now)
            node.admit()
            node.lifecycle_reason = "every admission check passed"
            if node.enrolled_at is not None:
                seconds, pool_name = max(0.0, (now - node.enrolled_at).total_seconds()), node.pool.name
                transaction.on_commit(lambda: metrics.ADMISSION_SECONDS.labels(pool_name).observe(seconds))
            data = {"attempt": attempt, "checks": [c.name for c in checks]}
        node.lifecycle_changed_at = now
        node.version += 1
        fields = ["lifecycle", "lifecycle_reason", "lifecycle_changed_at", "verified", "version", "updated_at"]
        node.save(update_fields=[*fields, *(("taints", "taints_added_at", "conditions") if lifted else ())])
        sync_device_counts(node)
        post_instructions([node.pk], Instruction.LIFECYCLE)
        record_event(
            node, event_types.LIFECYCLE, actor, from_state=before, to_state=node.lifecycle,
            reason=node.lifecycle_reason, data=data,
        )  # fmt: skip
    return node.lifecycle


# --- dispatching -------------------------------------------------------------------------------------


def run_admission_task():
    """The ``fleet.run_admission`` task, by name: fleet.tasks runs this module, so this module does
    not import it (no import cycle); fleet.apps imports fleet.tasks, so the name is registered."""
    return celery_app.signature("fleet.run_admission")


def dispatch_admission(node_id, attempt: int) -> None:
    def dispatch():
        failsafe.publish(run_admission_task(), args=(str(node_id), attempt))  # fails open: the stalled sweep catches up

    transaction.on_commit(dispatch)


def admissions_resume(*, now: datetime | None = None, stalled_after: timedelta = STALLED_AFTER) -> int:
    """Re-dispatch admission for nodes stuck ``admitting`` (a lost task, a worker crash).

    Nodes waiting on a benchmark that is still within its deadline are left alone. The task is
    idempotent, so a node dispatched twice is harmless. Returns how many were dispatched.
    """
    now = now or timezone.now()
    waiting = Benchmark.objects.filter(status=BenchmarkStatus.REQUESTED, deadline__gt=now).values("node_id")
    stalled = (
        Node.objects.filter(lifecycle=Lifecycle.ADMITTING, lifecycle_changed_at__lt=now - stalled_after)
        .exclude(pk__in=waiting)
        .values_list("pk", "admission_attempt")[:500]
    )
    task = run_admission_task()
    stalled = list(stalled)
    for node_id, attempt in stalled:
        task.delay(str(node_id), attempt)
    return len(stalled)
