"""Admin actions with their intermediate forms, through the Django test client."""

from __future__ import annotations

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import User

from fleet.models import Node, NodeEvent
from leases.models import Lease
from maintenance.models import DisruptionBudget, Drain, Quarantine
from tests.factories import make_schedulable_node, place_test_hold, set_lifecycle
from tests.maintenance_support import make_lease

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/fleet/node/"


@pytest.fixture
def node():
    return make_schedulable_node()[0]


def choose(client, action: str, *nodes, url: str = CHANGELIST):
    return client.post(url, {"action": action, ACTION_CHECKBOX_NAME: [str(n.pk) for n in nodes]})


def apply(client, action: str, data: dict, *objects, url: str = CHANGELIST):
    payload = {"action": action, "apply": "1", ACTION_CHECKBOX_NAME: [str(o.pk) for o in objects], **data}
    payload.update({f"version_{o.pk}": str(o.version) for o in objects})
    return client.post(url, payload, follow=True)


def test_the_cordon_action_shows_a_form_for_the_reason_first(admin_client, node):
    response = choose(admin_client, "cordon_nodes", node)

    assert response.status_code == 200
    assert b'name="reason"' in response.content
    assert f'name="version_{node.pk}" value="1"'.encode() in response.content
    node.refresh_from_db()
    assert node.lifecycle == "ready"


def test_the_cordon_action_applies_with_a_reason_and_records_it(admin_client, node):
    response = apply(admin_client, "cordon_nodes", {"reason": "bios update"}, node)

    assert response.status_code == 200
    node.refresh_from_db()
    assert (node.lifecycle, node.cordoned) == ("ready", True)
    hold = node.holds.get()
    assert (hold.owner, hold.reason) == ("user:ada-admin", "bios update")
    assert NodeEvent.objects.get(node=node, type="hold").actor_name == "ada-admin"


def test_an_action_without_a_reason_shows_the_form_again_and_changes_nothing(admin_client, node):
    response = apply(admin_client, "cordon_nodes", {"reason": ""}, node)

    assert b"This field is required" in response.content
    node.refresh_from_db()
    assert node.lifecycle == "ready"


def test_an_action_on_a_stale_version_reports_it_and_changes_nothing(admin_client, node):
    stale = Node.objects.get(pk=node.pk)
    Node.objects.filter(pk=node.pk).update(version=5)

    response = apply(admin_client, "cordon_nodes", {"reason": "x"}, stale)

    assert b"read it again" in response.content
    node.refresh_from_db()
    assert (node.lifecycle, node.cordoned) == ("ready", False)


def test_a_refused_transition_is_reported_with_the_allowed_actions(admin_client):
    node = set_lifecycle(make_schedulable_node()[0], "maintenance")

    response = apply(admin_client, "return_nodes_to_service", {"reason": "x"}, set_lifecycle(node, "pending"))

    assert b"allowed from pending: admit, cordon, quarantine, retire" in response.content


def test_uncordon_without_a_hold_of_ones_own_is_reported_and_changes_nothing(admin_client):
    node = place_test_hold(make_schedulable_node()[0], "user:olivia")

    response = apply(admin_client, "uncordon_nodes", {"reason": "x"}, node)

    assert b"is not yours" not in response.content
    assert b"user:ada-admin holds no cordon on this node; held by user:olivia" in response.content
    assert Node.objects.get(pk=node.pk).cordoned is True


def test_the_drain_action_takes_a_reason_a_policy_and_a_deadline(admin_client, node):
    make_lease(node, "job-1")
    form = choose(admin_client, "drain_nodes", node)
    assert b'name="deadline"' in form.content and b'name="policy"' in form.content

    apply(admin_client, "drain_nodes", {"reason": "rack", "policy": "wait", "deadline": "2099-01-01 00:00"}, node)
    assert not Drain.objects.exists()  # too far away: 422 shown as a message
    apply(admin_client, "drain_nodes", {"reason": "rack", "policy": "checkpoint", "deadline": _soon()}, node)

    drain = Drain.objects.get(node=node)
    assert (drain.policy, drain.reason, drain.requested_by_name) == ("checkpoint", "rack", "ada-admin")


def _soon() -> str:
    from datetime import timedelta

    from django.utils import timezone

    return (timezone.now() + timedelta(hours=2)).strftime("%Y-%m-%d %H:%M")


def test_the_quarantine_action_takes_reason_and_evidence(admin_client, node):
    lease = make_lease(node, "job-1")

    apply(admin_client, "quarantine_nodes", {"reason": "rootkit", "evidence": '{"hash": "ff"}'}, node)

    quarantine = Quarantine.objects.get(node=node)
    assert (quarantine.reason, quarantine.evidence) == ("rootkit", {"hash": "ff"})
    lease.refresh_from_db()
    assert lease.state == "revoked"


def test_release_return_to_service_and_retire_actions(admin_client):
    quarantined = set_lifecycle(make_schedulable_node()[0], "quarantined")
    parked = set_lifecycle(make_schedulable_node()[0], "maintenance")
    old = make_schedulable_node()[0]

    apply(admin_client, "release_nodes", {"reason": "reimaged"}, quarantined)
    apply(admin_client, "return_nodes_to_service", {"reason": "fixed"}, parked)
    apply(admin_client, "retire_nodes", {"reason": "eol"}, old)

    assert [Node.objects.get(pk=n.pk).lifecycle for n in (quarantined, parked, old)] == [
        "pending",
        "admitting",
        "retired",
    ]


def test_an_operator_without_the_release_permission_is_refused_in_the_admin(client):
    from django.contrib.auth.models import Group, Permission

    operators = Group.objects.get_or_create(name="operators")[0]
    operators.permissions.add(*Permission.objects.filter(content_type__app_label="fleet"))
    operators.permissions.remove(Permission.objects.get(codename="release_node"))
    staff = User.objects.create_user("sam-staff", password="pw", is_staff=True)
    staff.groups.add(operators)
    client.login(username="sam-staff", password="pw")
    node = set_lifecycle(make_schedulable_node()[0], "quarantined")

    response = apply(client, "release_nodes", {"reason": "x"}, node)

    assert b"needs the fleet.release_node permission" in response.content
    node.refresh_from_db()
    assert node.lifecycle == "quarantined"


def test_a_drain_is_cancelled_from_the_drain_admin_with_a_reason(admin_client, node):
    make_lease(node, "job-1")
    apply(admin_client, "drain_nodes", {"reason": "rack", "policy": "wait", "deadline": _soon()}, node)
    drain = Drain.objects.get(node=node)

    form = choose(admin_client, "cancel_drains", drain, url="/admin/maintenance/drain/")
    apply(admin_client, "cancel_drains", {"reason": "postponed"}, drain, url="/admin/maintenance/drain/")

    assert b'name="reason"' in form.content
    drain.refresh_from_db()
    assert drain.state == "cancelled"
    assert (Node.objects.get(pk=node.pk).lifecycle, Node.objects.get(pk=node.pk).cordoned) == ("ready", False)
    assert Lease.objects.get(node=node).state == "active"


def test_the_maintenance_admin_pages_render(admin_client, node):
    DisruptionBudget.objects.create(group="web", max_unavailable=1)
    make_lease(node, "job-1")
    apply(admin_client, "drain_nodes", {"reason": "rack", "policy": "wait", "deadline": _soon()}, node)

    for url in ["/admin/maintenance/drain/", "/admin/maintenance/disruptionbudget/", "/admin/maintenance/quarantine/"]:
        assert admin_client.get(url).status_code == 200
    drain = Drain.objects.get()
    assert admin_client.get(f"/admin/maintenance/drain/{drain.pk}/change/").status_code == 200
