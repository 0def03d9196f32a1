"""The admin site as nodepool's console (issue 33 item 6): its name, its sections, internals apart."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import Group, User

from nodepool.admin_site import INTERNALS, NodepoolAdminSite
from nodepool.api.permissions import OPERATORS, OWNERS

pytestmark = pytest.mark.django_db


def staff(username: str, group: str | None = None, **flags) -> User:
    user = User.objects.create_user(username, is_staff=True, **flags)
    if group:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


def sections(client, user) -> dict[str, list[str]]:
    client.force_login(user)
    response = client.get("/admin/")
    assert response.status_code == 200
    return {app["name"]: [m["name"] for m in app["models"]] for app in response.context["app_list"]}


def test_the_site_is_nodepools_on_every_page_the_login_included(client):
    assert isinstance(admin.site, NodepoolAdminSite)
    login = client.get("/admin/login/").content.decode()
    assert "Django administration" not in login and ">nodepool</a>" in login
    assert "<title>Log in | nodepool</title>" in login


def test_operators_see_their_sections_first_each_once_and_no_internals(client):
    shown = sections(client, staff("olivia", OPERATORS))
    assert list(shown) == ["Fleet", "Leases", "Maintenance", "Pool operations", "Marketplace"]
    assert shown["Fleet"][:2] == ["Fleet overview", "Nodes"]
    every = [name for names in shown.values() for name in names]
    assert len(every) == len(set(every))
    for internal in ("Fencing sequences", "Consistency reports", "Periodic tasks", "Solar events", "Clocked"):
        assert internal not in every
    assert "Leases on my nodes" not in every  # the owners' page; operators have Leases


def test_superusers_find_the_internals_grouped_apart_last(client):
    shown = sections(client, staff("root", is_superuser=True))
    assert list(shown)[-1] == INTERNALS
    for internal in ("Fencing sequences", "Consistency reports", "Users", "Groups", "Solar events", "Clocked"):
        assert internal in shown[INTERNALS]
    every = [name for names in shown.values() for name in names]
    assert len(every) == len(set(every))


def test_owners_see_their_marketplace_and_nodes_and_view_site_leads_to_their_nodes(client):
    owner = staff("oscar", OWNERS)
    shown = sections(client, owner)
    assert shown["Fleet"] == ["Nodes"]
    assert "Leases on my nodes" in shown["Marketplace"]
    assert client.get("/admin/").context["site_url"] == "/admin/fleet/node/"


def test_view_site_opens_the_fleet_overview_for_operators(client):
    client.force_login(staff("olivia", OPERATORS))
    page = client.get("/admin/")
    assert page.context["site_url"] == "/admin/fleet-overview/"
    assert '<a href="/admin/fleet-overview/">View site</a>' in page.content.decode()


def test_an_apps_own_page_keeps_djangos_list(client):
    client.force_login(staff("root", is_superuser=True))
    page = client.get("/admin/leases/")
    assert page.status_code == 200
    assert "Fencing sequences" in [m["name"] for m in page.context["app_list"][0]["models"]]
