"""An operator opens the fleet overview from the admin index in a real browser and reads a pool."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from fleet.models import LivenessSweepState, NodeResource
from leases.preview import refresh_request_class_fits
from tests.browser.conftest import login
from tests.factories import PoolFactory, make_schedulable_node


def test_operator_reads_a_pools_capacity_request_classes_and_guard(page, operator_user):
    gpu = PoolFactory(name="gpu", request_classes=[{"name": "two-cores", "resources": {"cpu": 2000}}])
    busy, _ = make_schedulable_node(gpu, hostname="busy", resources={"cpu": 8000, "memory": 2**35})
    NodeResource.objects.filter(node=busy, name="cpu").update(allocated=6000)
    make_schedulable_node(gpu, hostname="idle", resources={"cpu": 8000, "memory": 2**35})
    LivenessSweepState.objects.update_or_create(
        pk=1, defaults={"guarded_groups": {"gpu/eu-1": {"scope": "zone", "silent": 4, "total": 5}}}
    )

    refresh_request_class_fits()
    login(page, operator_user)
    page.get_by_role("link", name="Fleet overview").click()
    expect(page).to_have_url(re.compile(r"/admin/fleet-overview/$"))
    expect(page.get_by_role("heading", name="Pool gpu")).to_be_visible()
    card = page.get_by_role("region", name="pool gpu")
    expect(card.get_by_role("img", name="cpu 37.5% allocated")).to_be_visible()
    expect(card.locator(".request-classes")).to_contain_text("can serve two-cores: 5")
    expect(card.locator(".guard")).to_contain_text("zone eu-1: 4 of 5 silent")
    expect(card.locator(".schedulable")).to_have_text("2")


def test_an_owner_is_refused_the_fleet_overview(page, owner_user):
    login(page, owner_user)
    response = page.goto(f"{page.live_server_url}/admin/fleet-overview/")
    assert response.status == 403
