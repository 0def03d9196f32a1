"""The admin as a product (issue 33 item 6), at 1440 × 900 in a real browser: nodepool's name on the
login and the index, each section once, internals out of the operator's list, View site to the
fleet overview, the drain form at its own URL with a default deadline and one primary button,
the guard explained, and an owner with no statement told when the first one appears."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from maintenance.models import Drain
from tests.browser.conftest import login
from tests.factories import PoolFactory, make_schedulable_node


@pytest.fixture
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1440, "height": 900}}


def test_the_console_is_nodepools_with_the_operators_sections_first(page, operator_user):
    page.goto(f"{page.live_server_url}/admin/login/")
    expect(page).to_have_title(re.compile(r"\| nodepool$"))
    expect(page.locator("#site-name")).to_have_text("nodepool")
    expect(page.get_by_text("Django administration")).to_have_count(0)

    login(page, operator_user)
    expect(page.locator("#site-name")).to_have_text("nodepool")
    expect(page.get_by_role("heading", name="Fleet console")).to_be_visible()
    captions = page.locator("#content-main .module caption").all_inner_texts()
    assert [c.strip().lower() for c in captions] == ["fleet", "leases", "maintenance", "pool operations", "marketplace"]
    main = page.locator("#content-main")
    for internal in ("Fencing sequences", "Consistency reports", "Periodic tasks", "Solar events", "Clocked"):
        expect(main.get_by_role("link", name=internal, exact=True)).to_have_count(0)

    page.get_by_role("link", name="View site").click()
    expect(page).to_have_url(re.compile(r"/admin/fleet-overview/$"))
    expect(page.get_by_role("heading", name="Fleet overview")).to_be_visible()
    page.locator("#guard-help summary").click()  # the guard explained where its state is shown
    expect(page.locator("#guard-help")).to_contain_text("the control plane is more likely the one cut off")


def test_the_drain_form_has_its_own_url_a_default_deadline_and_one_primary_button(page, operator_user):
    node, _ = make_schedulable_node(PoolFactory(name="general"), hostname="rack07-cpu-b4.fra1.example.net")
    login(page, operator_user)
    page.goto(f"{page.live_server_url}/admin/fleet/node/{node.pk}/change/")
    page.locator("#section-actions").get_by_role("link", name="Drain…").click()

    drain_url = f"{page.live_server_url}/admin/fleet/node/{node.pk}/drain/"
    expect(page).to_have_url(drain_url)
    page.goto(drain_url)  # linkable: opened directly, the same form
    expect(page.get_by_label("Deadline in")).to_have_value("1")
    expect(page.get_by_label("unit")).to_have_value("hours")
    primary = page.locator("#content button.default")
    expect(primary).to_have_count(1)
    expect(primary).to_have_text("Drain")
    expect(page.locator("#content .button:not(.default)")).to_have_count(0)  # Cancel is a plain link

    page.get_by_label("Reason").fill("kernel 6.8 rollout")
    started = timezone.now()
    primary.click()
    expect(page).to_have_url(f"{page.live_server_url}/admin/fleet/node/{node.pk}/change/")
    expect(page.locator(".messagelist")).to_contain_text("Drain done for rack07-cpu-b4.fra1.example.net.")
    drain = Drain.objects.get(node=node)
    assert timedelta(minutes=59) < drain.deadline - started < timedelta(minutes=61)


def test_an_owner_with_no_statement_is_told_when_the_first_one_appears(page, owner_user):
    login(page, owner_user)
    page.goto(f"{page.live_server_url}/admin/marketplace/statement/")
    expect(page.get_by_role("heading", level=1)).to_have_text("Statements 0")
    expect(page.get_by_role("status")).to_contain_text(
        "Your first statement appears when the first lease on one of your nodes ends"
    )
