"""The node list and node page at 1440 × 900 (issue 33 items 2 and 5), in a real browser.

An operator reads, without scrolling, each row's schedulable verdict with its full reasons, its
free capacity (devices included), its liveness and the age of its last heartbeat; the count is at
the top; and a node that stopped reporting never shows readiness or health in green.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import login
from tests.browser.fleet_world import small_fleet

VIEWPORT = {"width": 1440, "height": 900}


@pytest.fixture
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": VIEWPORT}


def inside_viewport(locator) -> None:
    """``locator`` is drawn wholly inside the 1440 × 900 viewport (no horizontal scroll needed)."""
    box = locator.bounding_box()
    assert box is not None, "not drawn"
    assert box["x"] >= 0 and box["x"] + box["width"] <= VIEWPORT["width"], box
    assert box["y"] >= 0 and box["y"] + box["height"] <= VIEWPORT["height"], box


def row(page, node):
    return page.locator("#result_list tbody tr").filter(has_text=node.hostname)


def test_the_node_list_reads_at_a_glance_at_1440_px(page, operator_user):
    world = small_fleet()
    login(page, operator_user)
    page.goto(f"{page.live_server_url}/admin/fleet/node/")

    expect(page).to_have_title("Nodes | nodepool")
    heading = page.get_by_role("heading", level=1)
    expect(heading).to_have_text("Nodes 8")
    inside_viewport(heading)  # the count is at the top, not only under the table

    cordoned = row(page, world.gpu_cordoned)
    reason = cordoned.locator("td.field-schedulable_cell")
    # The whole reason, not "cordoned by user:…" cut off nor "(+4)" on hover.
    whole = "cordoned by user:olivia-operator (BMC firmware update booked with the vendor for Thursday)"
    expect(reason).to_contain_text(whole)
    quarantined = row(page, world.general_quarantined).locator("td.field-schedulable_cell")
    expect(quarantined).to_contain_text("lifecycle is quarantined")
    expect(quarantined).to_contain_text("no valid node credential")
    busy = row(page, world.gpu_busy)
    expect(busy.locator("td.field-free_cell")).to_contain_text("40 cpu · 64Gi")
    expect(busy.locator("td.field-free_cell")).to_contain_text("×H100")
    expect(busy.locator("td.field-liveness_cell")).to_contain_text("alive")
    expect(busy.locator("td.field-liveness_cell .np-age")).to_contain_text("ago")

    for node in (world.gpu_busy, world.gpu_cordoned, world.general_lost):
        cells = row(page, node)
        for column in ("schedulable_cell", "free_cell", "liveness_cell"):
            inside_viewport(cells.locator(f"td.field-{column}"))
        inside_viewport(cells.locator("td.field-liveness_cell .np-age"))
        inside_viewport(cells.locator("td.field-free_cell"))
    assert page.evaluate("document.documentElement.scrollWidth") <= VIEWPORT["width"]


def test_a_node_that_stopped_reporting_shows_unknown_in_grey_on_the_list_and_its_page(page, operator_user):
    world = small_fleet()
    login(page, operator_user)
    page.goto(f"{page.live_server_url}/admin/fleet/node/")

    for node in (world.gpu_unreachable, world.general_lost, world.general_silent):
        for column in ("readiness_cell", "health_cell"):
            badge = row(page, node).locator(f"td.field-{column} .np-badge")
            expect(badge).to_have_text("unknown")
            expect(badge).to_have_class("np-badge np-muted")
    alive = row(page, world.general_idle)
    expect(alive.locator("td.field-readiness_cell .np-badge")).to_have_class("np-badge np-ok")
    expect(row(page, world.gpu_unreachable).locator("td.field-readiness_cell .np-badge")).to_have_attribute(
        "title", "no current report; last reported ready"
    )

    page.get_by_role("link", name=world.gpu_unreachable.hostname).click()
    expect(page.get_by_role("heading", level=1)).to_have_text(f"Node {world.gpu_unreachable.hostname}")
    summary = page.locator("#section-summary")
    for name in ("readiness", "health"):
        badge = summary.locator(".np-badge-group").filter(has_text=name).locator(".np-badge")
        expect(badge).to_have_text("unknown")
        expect(badge).to_have_class("np-badge np-muted")
    expect(summary.get_by_role("row", name="last reported")).to_contain_text("ready, healthy (as of")
    inside_viewport(summary.locator(".np-badges"))
