"""Screenshots of the console at 1440 × 900 for a person to look at (issue 33, "Done when").

Skipped unless ``NODEPOOL_SCREENS`` names a directory: ``NODEPOOL_SCREENS=/tmp/screens
.venv/bin/python -m pytest -p no:xdist tests/browser/test_console_screens.py`` writes
``node-list.png``, ``node-page.png``, ``drain-form.png``, ``fleet-overview.png``, ``login.png``,
``index.png``, ``owner-index.png``, ``owner-quarantined-node.png`` and
``owner-no-statements.png`` there. CI does not run it (nothing to assert
that the other browser tests do not already).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from playwright.sync_api import expect

from tests.browser.conftest import login
from tests.browser.fleet_world import small_fleet
from tests.marketplace_support import owned_node, priced_pool

SCREENS = os.environ.get("NODEPOOL_SCREENS", "")
pytestmark = pytest.mark.skipif(not SCREENS, reason="set NODEPOOL_SCREENS=<dir> to write screenshots")


@pytest.fixture
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1440, "height": 900}}


def shoot(page, name: str, *, full_page: bool = False) -> None:
    Path(SCREENS).mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(Path(SCREENS) / f"{name}.png"), full_page=full_page)


def test_screens_of_the_operators_console(page, operator_user):
    world = small_fleet()
    base = page.live_server_url
    page.goto(f"{base}/admin/login/")
    shoot(page, "login")
    login(page, operator_user)
    shoot(page, "index", full_page=True)
    page.goto(f"{base}/admin/fleet/node/")
    expect(page.locator("#result_list tbody tr")).to_have_count(len(world.nodes))
    shoot(page, "node-list")
    page.goto(f"{base}/admin/fleet/node/{world.gpu_unreachable.pk}/change/")
    shoot(page, "node-page")
    page.goto(f"{base}/admin/fleet/node/{world.general_idle.pk}/change/")
    page.locator("#section-actions").get_by_role("link", name="Drain…").click()
    shoot(page, "drain-form")
    page.goto(f"{base}/admin/fleet-overview/")
    shoot(page, "fleet-overview", full_page=True)


def test_screen_of_an_owners_quarantined_node(page, owner_user):
    from fleet.events import Actor
    from maintenance import services as maintenance

    node = owned_node(priced_pool(), owner_user, "attic-box", hostname="attic-box.home.example.net")[0]
    maintenance.quarantine_node(node_id=node.pk, reason="checksum of the agent binary changed",
                                actor=Actor.system("ops"), evidence={"sha256": "9f2c"})  # fmt: skip
    login(page, owner_user)
    shoot(page, "owner-index", full_page=True)
    page.goto(f"{page.live_server_url}/admin/fleet/node/{node.pk}/change/")
    shoot(page, "owner-quarantined-node", full_page=True)
    page.goto(f"{page.live_server_url}/admin/marketplace/statement/")
    shoot(page, "owner-no-statements")
