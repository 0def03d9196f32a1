"""The status-report age is visible (issue 29, item 5): ``last_status_report_at`` and its age in the
API and the admin node page, and every "reported" time is the status report's, not the renewal's."""

from __future__ import annotations

import pytest

from fleet.models import Node
from tests.factories import make_schedulable_node
from tests.heartbeat_support import T0, seconds
from tests.support import staff_client

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("clock_at_t0")]


@pytest.fixture
def renewing_node(time_machine):
    """A node whose last status report came at T0 and whose last renewal at T0 + 290 s; now T0 + 300 s."""
    node, _ = make_schedulable_node()
    Node.objects.filter(pk=node.pk).update(last_status_report_at=T0, last_heartbeat_at=T0 + seconds(290))
    time_machine.move_to(T0 + seconds(300), tick=False)
    return node


def test_the_api_shows_when_the_last_status_report_came_and_how_old_it_is(operator_api, renewing_node):
    body = operator_api.get(f"/api/v1/nodes/{renewing_node.pk}").json()
    assert body["last_status_report_at"].startswith("2026-11-29T09:00:00")
    assert body["status_report_age_seconds"] == 300.0
    assert body["reported_readiness"]["reported_at"] == body["last_status_report_at"]
    assert body["last_heartbeat_at"].startswith("2026-11-29T09:04:50")  # the renewal's, apart


def test_a_node_that_never_reported_has_no_age(operator_api):
    node, _ = make_schedulable_node()
    body = operator_api.get(f"/api/v1/nodes/{node.pk}").json()
    assert body["last_status_report_at"] is None and body["status_report_age_seconds"] is None
    assert body["reported_readiness"]["reported_at"] is None


def test_the_age_moving_does_not_change_the_etag(operator_api, renewing_node, time_machine):
    first = operator_api.get(f"/api/v1/nodes/{renewing_node.pk}")
    time_machine.move_to(T0 + seconds(310), tick=False)
    second = operator_api.get(f"/api/v1/nodes/{renewing_node.pk}")
    assert second.json()["status_report_age_seconds"] == 310.0
    assert first["ETag"] == second["ETag"]


def test_the_admin_node_page_shows_the_status_report_time_and_age(operator, renewing_node):
    response = staff_client(operator).get(f"/admin/fleet/node/{renewing_node.pk}/change/")
    assert response.status_code == 200
    page = response.content.decode()
    # One absolute format and a kubectl age (humanunits.moment), as everywhere a person reads.
    assert '<th scope="row">last status report</th><td>2026-11-29 09:00:00 UTC (5m ago)</td>' in page
    assert '<th scope="row">last heartbeat</th><td>2026-11-29 09:04:50 UTC (10s ago)</td>' in page  # the renewal's


def test_the_admins_reported_readiness_is_the_status_reports_time(renewing_node):
    from django.contrib.admin import site

    shown = site._registry[Node].reported_readiness(Node.objects.get(pk=renewing_node.pk))
    assert shown == "ready, reported 2026-11-29 09:00:00 UTC"  # not the renewal's 09:04:50
