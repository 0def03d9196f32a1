"""Execution evidence: status reports open, extend and close evidence intervals (docs/marketplace.md)."""

from __future__ import annotations

import pytest
import time_machine

from leases.choices import EvidenceClose, LeaseState
from leases.fencing import lease_release
from leases.models import EvidenceInterval, Lease
from tests.marketplace_support import ACTOR, Reporter, at, grant_at, owned_node, priced_pool

pytestmark = pytest.mark.django_db


@pytest.fixture
def pool():
    return priced_pool()


@pytest.fixture
def node(pool, owner):
    return owned_node(pool, owner)[0]


def intervals(lease):
    return list(EvidenceInterval.objects.filter(lease=lease).order_by("started_at", "id"))


def spans(lease):
    return [(i.started_at, i.last_seen_at, i.close_reason) for i in intervals(lease)]


def test_a_status_report_listing_the_lease_opens_an_interval_and_later_ones_extend_it(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-a")
    reporter = Reporter(node)
    reporter.every(5, 65, [lease])
    [interval] = intervals(lease)
    assert (interval.started_at, interval.last_seen_at) == (at(5), at(65))
    assert interval.closed_at is None and interval.status_reports == 7
    assert interval.node_incarnation == 1 and interval.fencing_token == lease.fencing_token
    assert interval.usage_max == {"cpu": 2500, "memory": 2**30}


def test_a_report_omitting_the_lease_closes_the_interval_and_a_later_listing_opens_another(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-b")
    reporter = Reporter(node)
    reporter.every(5, 25, [lease])
    reporter.report(35, [])
    reporter.every(45, 65, [lease])
    assert spans(lease) == [(at(5), at(25), EvidenceClose.NOT_REPORTED), (at(45), at(65), "")]


def test_a_new_incarnation_closes_the_interval_and_opens_one_for_the_incarnation_that_adopts_the_lease(
    node, pool, client_user
):
    lease = grant_at(0, client_user, pool, "job-c")
    reporter = Reporter(node)
    reporter.every(5, 25, [lease])
    reporter.report(40, [lease], incarnation=2)
    reporter.report(50, [lease])
    [old, new] = intervals(lease)
    assert (old.last_seen_at, old.close_reason, old.node_incarnation) == (at(25), EvidenceClose.STALE_INCARNATION, 1)
    assert (new.started_at, new.last_seen_at, new.node_incarnation, new.closed_at) == (at(40), at(50), 2, None)


def test_a_restart_that_does_not_list_the_lease_closes_its_evidence_and_loses_it(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-d")
    reporter = Reporter(node)
    reporter.every(5, 25, [lease])
    reporter.report(40, [], incarnation=2)
    [interval] = intervals(lease)
    assert (interval.last_seen_at, interval.close_reason) == (at(25), EvidenceClose.STALE_INCARNATION)
    assert Lease.objects.get(pk=lease.pk).state == LeaseState.LOST


def test_a_report_after_more_than_the_grace_of_silence_closes_the_interval_as_silence(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-e")
    reporter = Reporter(node)
    reporter.every(5, 25, [lease])
    reporter.every(85, 95, [lease])  # 60 s of silence > the pool's 40 s grace
    assert spans(lease) == [(at(5), at(25), EvidenceClose.SILENCE), (at(85), at(95), "")]


def test_silence_within_the_grace_is_still_one_interval(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-f")
    reporter = Reporter(node)
    reporter.every(5, 25, [lease])
    reporter.every(60, 70, [lease])  # 35 s < 40 s grace
    assert spans(lease) == [(at(5), at(70), "")]


def test_a_report_with_another_fencing_token_closes_the_interval_as_token_mismatch(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-g")
    reporter = Reporter(node)
    reporter.every(5, 25, [lease])
    answer = reporter.report(35, [lease], token=lease.fencing_token + 7)
    assert str(lease.pk) in answer.stop_leases
    assert spans(lease) == [(at(5), at(25), EvidenceClose.TOKEN_MISMATCH)]


def test_the_lease_ending_closes_its_interval_and_no_report_after_it_is_evidence(node, pool, client_user):
    lease = grant_at(0, client_user, pool, "job-h")
    reporter = Reporter(node)
    reporter.every(5, 25, [lease])
    with time_machine.travel(at(30), tick=False):
        lease_release(
            lease_id=lease.pk,
            data={"fencing_token": lease.fencing_token, "node_incarnation": 1, "outcome": "succeeded"},
            user=client_user,
            actor=ACTOR,
        )
    reporter.report(35, [lease])
    assert spans(lease) == [(at(5), at(25), EvidenceClose.LEASE_ENDED)]


def test_a_node_without_live_leases_pays_no_evidence_query(node, django_assert_num_queries):
    reporter = Reporter(node)
    reporter.report(5, [])
    from leases.evidence import record_status_report

    with django_assert_num_queries(0):
        record_status_report(node=node, incarnation=1, live={}, listed=set(), mismatched=set(), now=at(6))


def _renewals(node, secret, reporter, times, *, sweep_at=()):
    """Renew at each of ``times`` through the real renewal service, sweeping liveness at ``sweep_at``."""
    from fleet.liveness_sweep import sweep_liveness
    from fleet.renewals import forget_cached_timings, renew

    forget_cached_timings()
    for t in sorted({*times, *sweep_at}):
        with time_machine.travel(at(t), tick=False):
            if t in times:
                reporter.sequence += 1
                renew(node_id=node.pk, secret=secret, incarnation=1, sequence=reporter.sequence)
            if t in sweep_at:
                sweep_liveness()


def test_renewals_between_status_reports_carry_the_interval_over_a_gap_longer_than_the_grace(pool, owner, client_user):
    node, secret = owned_node(pool, owner, "renewing")
    lease = grant_at(0, client_user, pool, "job-renewed", node=node)
    reporter = Reporter(node)
    reporter.report(5, [lease])
    _renewals(node, secret, reporter, times=range(15, 66, 10), sweep_at=(30, 60))
    reporter.report(70, [lease])  # 65 s after the last status report (> 40 s grace), renewed all along
    assert spans(lease) == [(at(5), at(70), "")]


def test_without_renewals_the_sweep_sees_the_silence_and_the_gap_is_not_carried(pool, owner, client_user):
    node, secret = owned_node(pool, owner, "silent")
    lease = grant_at(0, client_user, pool, "job-silent", node=node)
    reporter = Reporter(node)
    reporter.report(5, [lease])
    _renewals(node, secret, reporter, times=(), sweep_at=(30, 50, 65))  # unreachable after 40 s of grace
    reporter.report(70, [lease])
    assert spans(lease) == [(at(5), at(5), EvidenceClose.SILENCE), (at(70), at(70), "")]
