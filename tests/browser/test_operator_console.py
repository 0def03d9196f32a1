"""An operator runs the fleet from the admin in a real browser: the fleet list and its filters,
a node page, cordon and drain with a reason and the version read, a stale-version refusal, and a
quarantine with evidence."""

from __future__ import annotations

import re

from django.db.models import F
from playwright.sync_api import expect

from fleet.models import Node
from maintenance.models import Drain, Quarantine
from tests.factories import PoolFactory, make_schedulable_node, place_test_hold
from tests.maintenance_support import make_lease


def node_page(page, node):
    page.goto(f"{page.live_server_url}/admin/fleet/node/{node.pk}/change/")
    expect(page.get_by_role("heading", name="Summary")).to_be_visible()


def section(page, key: str):
    return page.locator(f"#section-{key}")


def test_the_fleet_list_filters_by_schedulable_and_by_reason(operator_page):
    page = operator_page
    gpu = PoolFactory(name="gpu")
    make_schedulable_node(gpu, hostname="gpu-a1")
    place_test_hold(make_schedulable_node(gpu, hostname="gpu-a2")[0], "user:olivia", "bios update")
    Node.objects.filter(pk=make_schedulable_node(gpu, hostname="gpu-a3")[0].pk).update(liveness="lost")

    page.goto(f"{page.live_server_url}/admin/fleet/node/")
    rows = page.locator("#result_list tbody tr")
    expect(rows).to_have_count(3)
    expect(rows.filter(has_text="gpu-a2")).to_contain_text("cordoned by user:olivia (bios update)")

    page.locator("#changelist-filter").get_by_role("link", name="no", exact=True).first.click()
    expect(rows).to_have_count(2)
    expect(page.locator("#result_list")).not_to_contain_text("gpu-a1")

    page.locator("#changelist-filter").get_by_role("link", name="not alive").click()
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("gpu-a3")
    expect(page).to_have_url(re.compile(r"unschedulable=not_alive"))


def test_a_node_page_reads_in_sections_with_human_units_and_its_leases(operator_page):
    page = operator_page
    node, _ = make_schedulable_node(hostname="rack3-n7", resources={"cpu": 8000, "memory": 25276063744})
    make_lease(node, "train-42", resources={"cpu": 2000, "memory": 2**30})

    node_page(page, node)

    for title in ("Actions", "Capability", "Resources", "Conditions", "Leases", "Events"):
        expect(page.get_by_role("heading", name=title, exact=True)).to_be_visible()
    expect(section(page, "summary")).to_contain_text("schedulable")
    resources = section(page, "resources").get_by_role("row").filter(has_text="memory")
    expect(resources).to_contain_text("23.5Gi")
    expect(section(page, "leases")).to_contain_text("train-42")
    expect(section(page, "leases").get_by_role("link", name="train-42")).to_be_visible()


def test_cordon_from_the_node_page_with_a_reason(operator_page):
    page = operator_page
    node, _ = make_schedulable_node(hostname="rack3-n1")
    node_page(page, node)

    actions = section(page, "actions")
    actions.get_by_text("Cordon", exact=True).click()
    actions.get_by_label("Reason").first.fill("bios update")
    actions.get_by_role("button", name="Cordon rack3-n1").click()

    expect(page.locator(".messagelist")).to_contain_text("Cordon (your own hold) done for rack3-n1.")
    expect(section(page, "summary")).to_contain_text("cordoned")
    expect(section(page, "maintenance").locator(".np-hold")).to_contain_text("user:olivia-operator — bios update")
    node.refresh_from_db()
    assert node.cordoned and node.holds.get().reason == "bios update"


def test_a_stale_page_is_refused_and_changes_nothing(operator_page):
    page = operator_page
    node, _ = make_schedulable_node(hostname="rack3-n2")
    node_page(page, node)
    actions = section(page, "actions")
    actions.get_by_text("Cordon", exact=True).click()
    actions.get_by_label("Reason").first.fill("bios update")

    Node.objects.filter(pk=node.pk).update(version=F("version") + 1)  # another operator acted meanwhile
    actions.get_by_role("button", name="Cordon rack3-n2").click()

    expect(page.locator(".messagelist .error")).to_contain_text("Cordon (your own hold) refused for rack3-n2")
    assert Node.objects.get(pk=node.pk).cordoned is False


def test_drain_with_a_relative_deadline_after_a_dry_run(operator_page):
    page = operator_page
    node, _ = make_schedulable_node(hostname="rack3-n3")
    make_lease(node, "job-7")
    node_page(page, node)

    section(page, "actions").get_by_role("link", name="Drain…").click()
    page.get_by_label("Policy").select_option("checkpoint")
    page.get_by_label("Deadline in").fill("2")
    page.get_by_label("unit").select_option("hours")
    page.get_by_label("Reason").fill("kernel update")
    page.get_by_role("button", name="Preview (dry run)").click()

    preview = page.locator(".np-preview")
    expect(preview).to_contain_text("nothing has changed yet")
    expect(preview.get_by_role("row").filter(has_text="job-7")).to_contain_text("checkpoint")
    assert not Drain.objects.exists()

    page.get_by_role("button", name="Drain", exact=True).click()
    expect(page.locator(".messagelist")).to_contain_text("Drain done for rack3-n3.")
    expect(section(page, "maintenance")).to_contain_text("active drain, policy checkpoint")
    drain = Drain.objects.get(node=node)
    assert (drain.reason, drain.policy) == ("kernel update", "checkpoint")


def test_quarantine_with_evidence(operator_page):
    page = operator_page
    node, _ = make_schedulable_node(hostname="rack3-n4")
    node_page(page, node)

    actions = section(page, "actions")
    actions.get_by_text("Quarantine", exact=True).click()
    form = actions.locator("form").filter(has=page.get_by_role("button", name="Quarantine rack3-n4"))
    form.get_by_label("Reason").fill("unexpected outbound traffic")
    form.get_by_label("Evidence (JSON object)").fill('{"flows": 1200, "dst": "203.0.113.9"}')
    form.get_by_role("button", name="Quarantine rack3-n4").click()

    expect(page.locator(".messagelist")).to_contain_text("Quarantine done for rack3-n4.")
    evidence = section(page, "maintenance").get_by_role("table", name="Quarantine evidence")
    expect(evidence).to_contain_text("203.0.113.9")
    assert Quarantine.objects.get(node=node).evidence == {"flows": 1200, "dst": "203.0.113.9"}
