"""Node availability evidence: status reports open, extend and close the intervals in which a node
offered its allocatable capacity (docs/marketplace.md, "Availability evidence")."""

from __future__ import annotations

import pytest
from django.db.models import F

from fleet.models import Node
from marketplace.availability import record_status_report
from marketplace.models import AvailabilityClose, NodeAvailability
from tests.marketplace_support import Reporter, at, owned_node, priced_pool

pytestmark = pytest.mark.django_db


@pytest.fixture
def pool():
    return priced_pool()


@pytest.fixture
def node(pool, owner):
    return owned_node(pool, owner)[0]


def spans(node):
    return [
        (a.started_at, a.last_seen_at, a.end_reason)
        for a in NodeAvailability.objects.filter(node=node).order_by("started_at", "id")
    ]


def test_status_reports_open_one_interval_with_the_allocatable_snapshot_and_extend_it(node, owner):
    Reporter(node).every(0, 60, [])
    [interval] = NodeAvailability.objects.filter(node=node)
    assert (interval.started_at, interval.last_seen_at, interval.ended_at) == (at(0), at(60), None)
    assert interval.allocatable == {"cpu": 8000, "memory": 32 * 2**30}
    assert interval.owner == owner and interval.pool_id == node.pool_id and interval.incarnation == 1


def test_silence_beyond_the_grace_closes_the_interval_at_its_last_evidence(node):
    reporter = Reporter(node)
    reporter.every(0, 20, [])
    reporter.report(200, [])
    assert spans(node) == [(at(0), at(20), AvailabilityClose.SILENCE), (at(200), at(200), "")]


def test_a_restart_closes_the_interval_and_the_new_incarnation_opens_another(node):
    reporter = Reporter(node)
    reporter.every(0, 20, [])
    reporter.report(30, [], incarnation=2)
    assert spans(node) == [(at(0), at(20), AvailabilityClose.RESTART), (at(30), at(30), "")]


def test_a_change_of_the_node_takes_a_new_capacity_snapshot(node):
    reporter = Reporter(node)
    reporter.every(0, 20, [])
    Node.objects.filter(pk=node.pk).update(version=F("version") + 1)
    node.resources.filter(name="cpu").update(allocatable=4000)
    reporter.report(30, [])
    assert spans(node) == [(at(0), at(20), AvailabilityClose.CHANGED), (at(30), at(30), "")]
    assert NodeAvailability.objects.get(ended_at__isnull=True).allocatable["cpu"] == 4000


def test_a_long_span_is_cut_hourly_without_a_gap(node):
    reporter = Reporter(node)
    reporter.every(0, 3600, [], step=30)
    reporter.report(3630, [])
    first, second = NodeAvailability.objects.order_by("started_at")
    assert (first.last_seen_at, first.end_reason) == (at(3600), AvailabilityClose.CUT)
    assert (second.started_at, second.last_seen_at, second.ended_at) == (at(3600), at(3630), None)


def test_a_node_that_does_not_offer_records_nothing_and_closes_what_was_open(node):
    reporter = Reporter(node)
    reporter.every(0, 20, [])
    Node.objects.filter(pk=node.pk).update(cordoned=True, version=F("version") + 1)
    reporter.report(30, [])
    assert spans(node) == [(at(0), at(20), AvailabilityClose.NOT_OFFERING)]


def test_a_continuing_interval_costs_one_statement(node, django_assert_num_queries):
    Reporter(node).every(0, 10, [])
    fresh = Node.objects.select_related("pool").get(pk=node.pk)
    fresh.last_status_report_at = at(20)
    with django_assert_num_queries(1):
        record_status_report(Node, node=fresh, incarnation=1)
    assert NodeAvailability.objects.get().last_seen_at == at(20)
