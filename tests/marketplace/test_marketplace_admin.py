"""The owner's admin: only their rows, no link to a page they cannot open, only actions they may take;
the operators' appeal queue."""

from __future__ import annotations

import re
from urllib.parse import urljoin, urlparse

import pytest
import time_machine

from fleet.events import Actor
from leases.fencing import lease_release
from maintenance import services as maintenance
from marketplace.models import Appeal, UsageRecord
from marketplace.reconciliation import reconcile_usage
from tests.marketplace_support import ACTOR, Reporter, at, grant_at, owned_node, priced_pool
from tests.support import staff_client

pytestmark = pytest.mark.django_db
OPERATOR = Actor.system("operator-test")
HREF = re.compile(r'href="([^"#]+)"')


logged_in = staff_client


@pytest.fixture
def world(owner, other_owner, client_user):
    pool = priced_pool()
    node = owned_node(pool, owner, "mine")[0]
    theirs = owned_node(pool, other_owner, "theirs")[0]
    for who, n in (("mine", node), ("theirs", theirs)):
        lease = grant_at(0, client_user, pool, f"job-{who}", node=n)
        Reporter(n).every(10, 60, [lease])
        with time_machine.travel(at(65), tick=False):
            lease_release(
                lease_id=lease.pk,
                data={"fencing_token": lease.fencing_token, "node_incarnation": 1},
                user=client_user,
                actor=ACTOR,
            )
        reconcile_usage(UsageRecord.objects.get(lease=lease).pk, actor=ACTOR, force=True)
    maintenance.quarantine_node(
        node_id=node.pk,
        reason="hash mismatch",
        actor=OPERATOR,
        evidence={"hash": "abc", "private": {"informant": "tip-line"}},
    )
    return {"node": node, "theirs": theirs}


def crawl(browser, start="/admin/", limit=150):
    """Every admin page reachable by links from ``start``: {url: status}."""
    seen, queue = {}, [start]
    while queue and len(seen) < limit:
        url = queue.pop(0)
        if url in seen:
            continue
        answer = browser.get(url)
        seen[url] = answer.status_code
        if answer.status_code != 200 or "html" not in answer.get("Content-Type", ""):
            continue
        for href in HREF.findall(answer.content.decode()):
            target = urljoin(url, href.replace("&amp;", "&"))
            path = urlparse(target)
            sorting = any(key in path.query for key in ("o=", "_changelist_filters", "_facets"))
            if path.path.startswith("/admin/") and "logout" not in path.path and not sorting:
                queue.append(path.path + (f"?{path.query}" if path.query else ""))
            elif path.path.startswith("/api/"):
                queue.insert(0, path.path)
    return seen


def test_every_link_on_the_owners_pages_opens(world, owner):
    pages = crawl(logged_in(owner))
    assert {url: status for url, status in pages.items() if status != 200} == {}
    visited = " ".join(pages)
    for expected in (
        "/admin/fleet/node/",
        "/admin/marketplace/usagerecord/",
        "/admin/marketplace/statement/",
        "/admin/marketplace/ownedquarantine/",
        "/admin/marketplace/ownedlease/",
        "export.csv",
    ):
        assert expected in visited, expected
    for forbidden in ("/admin/fleet/pool/", "/admin/auth/user/", "/admin/fleet/bootstraptoken/"):
        assert forbidden not in visited, forbidden


def test_the_owners_node_page_offers_no_operator_action_and_links_to_the_quarantine(world, owner):
    browser = logged_in(owner)
    listing = browser.get("/admin/fleet/node/").content.decode()
    assert 'name="action"' not in listing  # no action menu at all
    page = browser.get(f"/admin/fleet/node/{world['node'].pk}/change/").content.decode()
    assert "Appeal this quarantine" in page and "What you can do next" in page and "tip-line" not in page
    assert "/admin/fleet/pool/" not in page and "/admin/auth/user/" not in page
    assert browser.get(f"/admin/fleet/node/{world['theirs'].pk}/change/").status_code == 302


def test_the_owner_reads_the_quarantine_without_private_evidence_and_appeals(world, owner, operator):
    browser = logged_in(owner)
    [quarantine_url] = [u for u in crawl(browser) if re.match(r"/admin/marketplace/ownedquarantine/\d+/change/", u)]
    page = browser.get(quarantine_url).content.decode()
    assert "hash mismatch" in page and "abc" in page and "tip-line" not in page
    assert "appeal with what you know" in page  # the next steps for an operator's quarantine
    quarantine_id = int(quarantine_url.split("/")[-3])
    add = browser.post("/admin/marketplace/appeal/add/", {"quarantine": quarantine_id, "statement": "Disk fault."})
    assert add.status_code == 302
    appeal = Appeal.objects.get()
    assert (appeal.owner, appeal.state, appeal.statement) == (owner, "open", "Disk fault.")
    assert "Appeal this quarantine" not in browser.get(quarantine_url).content.decode()

    # The operators' queue: an intermediate form with the version, then the node is released.
    ops = logged_in(operator)
    assert "Disk fault" in ops.get("/admin/marketplace/appeal/?state__exact=open").content.decode()
    form = ops.post("/admin/marketplace/appeal/", {"action": "overturn_appeals", "_selected_action": [appeal.pk]})
    assert form.status_code == 200 and f'name="version_{appeal.pk}" value="1"' in form.content.decode()
    done = ops.post(
        "/admin/marketplace/appeal/",
        {
            "action": "overturn_appeals",
            "_selected_action": [appeal.pk],
            "apply": "1",
            f"version_{appeal.pk}": "1",
            "reason": "Confirmed.",
        },
    )
    assert done.status_code == 302
    appeal.refresh_from_db()
    world["node"].refresh_from_db()
    assert (appeal.state, appeal.resolution, world["node"].lifecycle) == ("overturned", "Confirmed.", "pending")
    assert "Confirmed." in browser.get(quarantine_url).content.decode()


def test_the_owner_sees_only_their_usage_and_statements(world, owner, other_owner):
    browser = logged_in(owner)
    mine = UsageRecord.objects.get(owner=owner)
    theirs = UsageRecord.objects.get(owner=other_owner)
    listing = browser.get("/admin/marketplace/usagerecord/").content.decode()
    assert "job-mine" in listing and "job-theirs" not in listing
    assert browser.get(f"/admin/marketplace/usagerecord/{mine.pk}/change/").status_code == 200
    assert browser.get(f"/admin/marketplace/usagerecord/{theirs.pk}/change/").status_code == 302
    assert browser.get(f"/admin/marketplace/ownedlease/{theirs.lease_id}/change/").status_code == 302
    lease_page = browser.get(f"/admin/marketplace/ownedlease/{mine.lease_id}/change/").content.decode()
    assert "Evidence intervals" in lease_page and "sleep" not in lease_page  # not the client's command
    assert browser.get("/admin/marketplace/poolprice/").status_code == 403
