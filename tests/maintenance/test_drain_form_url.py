"""The drain form's own URL, /admin/fleet/node/<id>/drain/ (issue 33 item 6): who may open it, its
default deadline, and a refusal that changes nothing."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import Group, User
from django.db.models import F

from fleet.models import Node
from maintenance.models import Drain
from nodepool.api.permissions import OWNERS
from tests.factories import make_schedulable_node

pytestmark = pytest.mark.django_db


def drain_url(node_id) -> str:
    return f"/admin/fleet/node/{node_id}/drain/"


def test_the_form_opens_at_its_own_url_with_a_one_hour_deadline_and_the_version_read(admin_client):
    node, _ = make_schedulable_node(hostname="rack3-n9")
    page = admin_client.get(drain_url(node.pk))
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="deadline_in" value="1"' in html
    assert f'name="version_{node.pk}" value="{node.version}"' in html
    assert html.count('class="button default"') == 1


def test_applying_from_the_url_drains_and_returns_to_the_node_page(admin_client):
    node, _ = make_schedulable_node(hostname="rack3-n9")
    body = {"apply": "1", "policy": "wait", "deadline_in": "1", "deadline_unit": "hours", "reason": "kernel",
            f"version_{node.pk}": str(node.version)}  # fmt: skip
    response = admin_client.post(drain_url(node.pk), body)
    assert response.status_code == 302 and response["Location"] == f"/admin/fleet/node/{node.pk}/change/"
    assert Drain.objects.get(node=node).reason == "kernel"


def test_a_stale_version_is_refused_and_nothing_changes(admin_client):
    node, _ = make_schedulable_node(hostname="rack3-n9")
    stale = node.version
    Node.objects.filter(pk=node.pk).update(version=F("version") + 1)
    body = {"apply": "1", "policy": "wait", "deadline_in": "1", "deadline_unit": "hours", "reason": "kernel",
            f"version_{node.pk}": str(stale)}  # fmt: skip
    admin_client.post(drain_url(node.pk), body)
    assert not Drain.objects.exists()
    assert Node.objects.get(pk=node.pk).lifecycle == "ready"


def test_an_unknown_node_is_404_and_an_owner_is_refused(client, admin_client):
    assert admin_client.get(drain_url(uuid.uuid4())).status_code == 404
    owner = User.objects.create_user("oscar", is_staff=True)
    owner.groups.add(Group.objects.get_or_create(name=OWNERS)[0])
    node, _ = make_schedulable_node()
    Node.objects.filter(pk=node.pk).update(owner=owner)
    client.force_login(owner)
    assert client.get(drain_url(node.pk)).status_code == 403
