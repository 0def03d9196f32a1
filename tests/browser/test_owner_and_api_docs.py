"""A marketplace owner reads their quarantined node (theirs only, the evidence, no dead links),
and the API docs page renders its operations, grouped by area."""

from __future__ import annotations

from playwright.sync_api import expect

from fleet.events import Actor
from maintenance.services import quarantine_node
from tests.factories import PoolFactory, make_schedulable_node


def test_the_owner_sees_only_their_quarantined_node_with_its_evidence_and_no_dead_links(owner_page, owner_user):
    page = owner_page
    market = PoolFactory(name="marketplace")
    mine, _ = make_schedulable_node(market, hostname="oscars-box", owner=owner_user)
    make_schedulable_node(market, hostname="someone-elses-box")
    quarantine_node(
        node_id=mine.pk,
        reason="benchmark answered with 30 % of declared cpu",
        evidence={"declared_cpu": "8 cores", "measured_cpu": "2.4 cores"},
        actor=Actor.system("admission"),
    )

    page.goto(f"{page.live_server_url}/admin/fleet/node/")
    rows = page.locator("#result_list tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("quarantined")
    expect(page.locator("#result_list")).not_to_contain_text("someone-elses-box")

    rows.first.get_by_role("link", name="oscars-box").click()
    maintenance = page.locator("#section-maintenance")
    expect(maintenance).to_contain_text("benchmark answered with 30 % of declared cpu")
    expect(maintenance.get_by_role("table", name="Quarantine evidence")).to_contain_text("2.4 cores")
    expect(page.locator("#section-actions")).to_have_count(0)  # owners read; operators act
    # The evidence of an open quarantine is shown once (under maintenance), not again in the
    # marketplace section, which keeps the reason, the next steps and the appeal link.
    expect(page.get_by_role("table", name="Evidence shown to the owner")).to_have_count(0)
    expect(page.locator("#section-marketplace")).to_contain_text("What you can do next")

    hrefs = page.locator("#content a[href]").evaluate_all("links => links.map(a => a.getAttribute('href'))")
    for href in {h for h in hrefs if h.startswith("/")}:
        response = page.request.get(f"{page.live_server_url}{href}")
        assert response.status == 200, (href, response.status)


def scroll_until_rendered(page, locator, *, steps: int = 80):
    """Scroll down until ``locator`` is in the DOM. Swagger UI (drf-spectacular-sidecar 2026.10)
    renders its tag sections and models in a virtual list: only what is near the viewport exists
    in the DOM, so a tag further down has no element until a person scrolls to it."""
    for _ in range(steps):
        if locator.count():
            locator.first.scroll_into_view_if_needed()
            return locator.first
        page.mouse.wheel(0, 600)
        page.wait_for_timeout(100)
    return locator.first  # the caller's expect() reports what is missing


def test_the_api_docs_page_renders_operations_grouped_by_area(page):
    page.goto(f"{page.live_server_url}/api/docs/")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("nodepool API")
    expect(page.locator("#operations-tag-pools")).to_be_visible()
    page.mouse.move(640, 400)  # the wheel scrolls what is under the pointer
    for tag in ("pools", "enrollment", "nodes", "maintenance", "leases"):
        page.evaluate("window.scrollTo(0, 0)")
        expect(scroll_until_rendered(page, page.locator(f"#operations-tag-{tag.replace(' ', '_')}"))).to_be_visible()
    page.evaluate("window.scrollTo(0, 0)")
    drain = scroll_until_rendered(page, page.locator(".opblock").filter(has_text="/api/v1/nodes/{id}/drain"))
    expect(drain).to_be_visible()
    drain.locator(".opblock-summary").click()
    expect(drain).to_contain_text("dry_run")
