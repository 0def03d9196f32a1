"""Usage after a node failed a scheduled re-verification is flagged for review in reconciliation
(issue 32 item 2: the ``node_deverified`` finding flags the statement line, which holds the payout)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine

from fleet import benchmarks, reverification
from fleet.models import Benchmark, Node, Pool, Reverification
from leases.fencing import lease_release
from marketplace.choices import UsageState
from marketplace.holds import REVIEW_FINDINGS
from marketplace.models import UsageRecord
from marketplace.reconciliation import reconcile_usage
from tests.marketplace_support import ACTOR, Reporter, at, grant_at, owned_node, priced_pool

pytestmark = pytest.mark.django_db


def _recheck(node, seconds: float, *, cpu: int) -> str:
    """A scheduled re-verification of ``node`` run at ``T0 + seconds``, answered with ``cpu`` millicores."""
    reverification.reverifications_schedule(now=at(seconds))
    Reverification.objects.filter(node=node, state="scheduled").update(due_at=at(seconds - 1))
    assert (
        reverification.reverification_start(
            run_id=Reverification.objects.get(node=node, state="scheduled").pk, actor=ACTOR, now=at(seconds)
        )
        == "started"
    )
    bench = Benchmark.objects.get(node=node, status="requested")
    figures = {"cpu_millicores": cpu, "memory_bytes": 32 * 2**30, "duration_seconds": 1.0, "details": {}}
    benchmarks.benchmark_complete(node=node, nonce=bench.nonce, figures=figures, actor=ACTOR, now=at(seconds + 1))
    return Reverification.objects.filter(node=node).exclude(state="scheduled").order_by("-finished_at")[0].state


def _run(client_user, pool, node, reporter, start: float, end: float, name: str, meanwhile=None) -> UsageRecord:
    lease = grant_at(start, client_user, pool, name, node=node)
    reporter.every(start + 5, end - 5, [lease])
    if meanwhile is not None:
        meanwhile()
    with time_machine.travel(at(end), tick=False):
        lease_release(lease_id=lease.pk, data={"fencing_token": lease.fencing_token,
                      "node_incarnation": lease.node_incarnation}, user=client_user, actor=ACTOR)  # fmt: skip
    record = UsageRecord.objects.get(lease=lease)
    return reconcile_usage(record.pk, actor=ACTOR, now=record.ended_at + timedelta(seconds=1000))


def test_usage_after_a_failed_check_is_flagged_until_a_later_check_passes(owner, client_user):
    pool = priced_pool()
    Pool.objects.filter(pk=pool.pk).update(reverification_period=3600, reverification_window=600)
    with time_machine.travel(at(-60), tick=False):
        node, _ = owned_node(pool, owner, "m")
    reporter = Reporter(node)

    before = _run(client_user, pool, node, reporter, 0, 40, "before")

    def failing():  # while a lease runs: the check measures what is free (the default "free" policy)
        assert _recheck(Node.objects.get(pk=node.pk), 120, cpu=1000) == "failed"

    during = _run(client_user, pool, node, reporter, 100, 140, "during", meanwhile=failing)
    assert Reverification.objects.filter(node=node, state="failed").count() == 1
    assert _recheck(Node.objects.get(pk=node.pk), 200, cpu=8000) == "passed"
    after = _run(client_user, pool, node, reporter, 300, 340, "after")

    codes = {name: {f["code"] for f in r.findings} for name, r in (("before", before), ("during", during),
                                                                    ("after", after))}  # fmt: skip
    assert "node_deverified" not in codes["before"] | codes["after"]
    assert "node_deverified" in codes["during"] and "node_deverified" in REVIEW_FINDINGS
    (finding,) = [f for f in during.findings if f["code"] == "node_deverified"]
    assert "measured_below_verified" in finding["message"]
    # the finding flags the line for review; the node did not lie about its usage, so it is still paid
    assert during.state == UsageState.RECONCILED and during.billable_seconds > 0
