"""A marketplace owner in a real browser: their quarantined node, the evidence they may see, what to
do next, an appeal, their usage and statement — and no operator action anywhere."""

from __future__ import annotations

import re

import time_machine
from playwright.sync_api import expect

from fleet.events import Actor
from leases.fencing import lease_release
from maintenance import services as maintenance
from marketplace.models import Appeal, UsageRecord
from marketplace.reconciliation import reconcile_usage
from tests.browser.conftest import login
from tests.marketplace_support import ACTOR, Reporter, at, grant_at, owned_node, priced_pool


def owners_world(owner, client_user):
    pool = priced_pool()
    node = owned_node(pool, owner, "attic-box", hostname="attic-box.example.test")[0]
    lease = grant_at(0, client_user, pool, "render-42", node=node)
    Reporter(node).every(10, 60, [lease])
    with time_machine.travel(at(65), tick=False):
        lease_release(lease_id=lease.pk, data={"fencing_token": lease.fencing_token, "node_incarnation": 1},
                      user=client_user, actor=ACTOR)  # fmt: skip
    reconcile_usage(UsageRecord.objects.get(lease=lease).pk, actor=ACTOR, force=True)
    maintenance.quarantine_node(node_id=node.pk, reason="checksum of the agent binary changed",
                                actor=Actor.system("ops"),
                                evidence={"sha256": "9f2c", "private": {"informant": "tip-line-7"}})  # fmt: skip
    return node


def test_the_owner_reads_their_quarantined_node_and_appeals(page, owner_user, client_user):
    node = owners_world(owner_user, client_user)
    login(page, owner_user)

    page.get_by_role("link", name="Nodes", exact=True).first.click()
    expect(page.locator("select[name=action]")).to_have_count(0)  # no operator actions offered
    page.get_by_role("link", name=re.compile("attic-box")).first.click()
    expect(page.get_by_text("quarantined").first).to_be_visible()
    expect(page.locator("a[href*='/admin/fleet/pool/']")).to_have_count(0)
    expect(page.locator("a[href*='/admin/auth/user/']")).to_have_count(0)

    expect(page.get_by_text("tip-line-7")).to_have_count(0)  # the node page's evidence is the owner's too
    page.get_by_role("link", name="Quarantine details").click()
    expect(page.get_by_text("checksum of the agent binary changed")).to_be_visible()
    expect(page.get_by_text("9f2c")).to_be_visible()
    expect(page.get_by_text("tip-line-7")).to_have_count(0)
    expect(page.get_by_text("appeal with what you know")).to_be_visible()

    page.get_by_role("link", name="Appeal this quarantine").click()
    page.get_by_label("Statement").fill("The binary changed because I upgraded the agent from the release page.")
    page.get_by_role("button", name="Save", exact=True).click()
    expect(page.get_by_text("was added successfully")).to_be_visible()
    assert Appeal.objects.get(node=node).state == "open"

    page.goto(f"{page.live_server_url}/admin/marketplace/statement/")
    page.get_by_role("link", name=re.compile("oscar-owner")).first.click()
    expect(page.get_by_text("0.02 EUR").first).to_be_visible()
    expect(page.get_by_role("link", name="CSV")).to_be_visible()
    page.goto(f"{page.live_server_url}/admin/marketplace/usagerecord/")
    expect(page.locator("#result_list tbody tr")).to_have_count(1)
    expect(page.locator("#result_list")).to_contain_text("render-42")
