"""An operator logs in to the admin in a real browser and reads the fleet's node list."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from tests.browser.conftest import login
from tests.factories import PoolFactory, make_schedulable_node


def test_operator_logs_in_and_sees_the_node_list(page, operator_user):
    gpu = PoolFactory(name="gpu")
    make_schedulable_node(gpu, hostname="rack1-n1.example.test")
    make_schedulable_node(gpu, hostname="rack1-n2.example.test")

    login(page, operator_user)
    expect(page.get_by_role("heading", name="Fleet console")).to_be_visible()
    page.get_by_role("link", name="Nodes", exact=True).first.click()

    expect(page).to_have_url(re.compile(r"/admin/fleet/node/$"))
    rows = page.locator("#result_list tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.first).to_contain_text("rack1-n1.example.test")
    expect(rows.nth(1)).to_contain_text("rack1-n2.example.test")


def test_a_wrong_password_is_refused_and_shows_no_admin(page, operator_user):
    login_url = f"{page.live_server_url}/admin/login/"
    page.goto(login_url)
    page.get_by_label("Username").fill(operator_user.username)
    page.get_by_label("Password").fill("not-the-password")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator(".errornote")).to_contain_text("correct username and password")
    expect(page.get_by_role("heading", name="Fleet console")).to_have_count(0)
