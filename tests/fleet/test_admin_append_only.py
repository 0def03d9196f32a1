"""Audit records are append-only in the admin (issue 12, case 7), a stuck draining node can be
repaired by a recorded operator action, and readiness is shown as reported (case 8)."""

from __future__ import annotations

import re

import pytest
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.test import RequestFactory
from django.utils import timezone

from fleet import event_types as fleet_events
from fleet.admin import AdmissionCheckInline, NodeCredentialInline, NodeHoldInline
from fleet.choices import Lifecycle, Liveness
from fleet.models import BootstrapToken, Node, NodeEvent
from leases.models import ConsistencyReport, Lease, LeaseRequest
from maintenance.admin import EvictionInline
from maintenance.models import Drain, Quarantine
from tests.factories import make_schedulable_node, set_lifecycle
from tests.fleet_support import make_token
from tests.maintenance_support import act, make_lease

pytestmark = pytest.mark.django_db

NO_DELETE = [Drain, Quarantine, Lease, LeaseRequest, ConsistencyReport, BootstrapToken]
READ_ONLY = [Drain, Quarantine, Lease, ConsistencyReport]
NO_DELETE_INLINES = [EvictionInline, AdmissionCheckInline, NodeCredentialInline, NodeHoldInline]


def admin_url(model, suffix: str = "") -> str:
    return f"/admin/{model._meta.app_label}/{model._meta.model_name}/{suffix}"


@pytest.mark.parametrize("model", NO_DELETE, ids=lambda m: m.__name__)
def test_audit_records_cannot_be_deleted_from_the_admin_even_by_a_superuser(admin_user, model):
    request = RequestFactory().get("/admin/")
    request.user = admin_user
    model_admin = admin.site._registry[model]

    assert model_admin.has_delete_permission(request) is False
    assert "delete_selected" not in model_admin.get_actions(request)


@pytest.mark.parametrize("inline", NO_DELETE_INLINES, ids=lambda i: i.__name__)
def test_audit_records_shown_inline_cannot_be_deleted_either(admin_user, inline):
    request = RequestFactory().get("/admin/")
    request.user = admin_user

    assert inline(inline.model, admin.site).has_delete_permission(request) is False


def test_deleting_a_drain_is_refused_and_its_node_stays_consistent(admin_client, operator_api):
    node, _ = make_schedulable_node()
    make_lease(node, "job-1")
    drain_id = act(operator_api, node, "drain", {"reason": "rack", "deadline_in": 600}).json()["id"]

    page = admin_client.get(admin_url(Drain, f"{drain_id}/delete/"))
    bulk = admin_client.post(admin_url(Drain), {"action": "delete_selected", ACTION_CHECKBOX_NAME: [drain_id]})

    assert page.status_code == 403
    assert bulk.status_code in (200, 302)
    assert Drain.objects.filter(pk=drain_id, state="active").exists()


def test_a_quarantine_record_cannot_be_deleted(admin_client, operator_api):
    node, _ = make_schedulable_node()
    act(operator_api, node, "quarantine", {"reason": "incident"})
    quarantine = Quarantine.objects.get()

    assert admin_client.get(admin_url(Quarantine, f"{quarantine.pk}/delete/")).status_code == 403
    assert Quarantine.objects.filter(pk=quarantine.pk).exists()


def test_a_bootstrap_token_is_revoked_not_deleted(admin_client):
    node, _ = make_schedulable_node()
    make_token(node.pool)
    token = BootstrapToken.objects.get()

    assert admin_client.get(admin_url(BootstrapToken, f"{token.pk}/delete/")).status_code == 403
    assert BootstrapToken.objects.filter(pk=token.pk).exists()


@pytest.mark.parametrize("model", READ_ONLY, ids=lambda m: m.__name__)
def test_read_only_records_show_no_save_buttons(admin_client, operator_api, model):
    node, _ = make_schedulable_node()
    make_lease(node, "job-1")
    act(operator_api, node, "drain", {"reason": "rack", "deadline_in": 600})
    other, _ = make_schedulable_node(node.pool)
    act(operator_api, other, "quarantine", {"reason": "incident"})
    ConsistencyReport.objects.create(nodes_checked=1, drift=[], repaired=False)
    record = model.objects.first()

    response = admin_client.get(admin_url(model, f"{record.pk}/change/"))

    assert response.status_code == 200
    assert b'name="_save"' not in response.content
    assert b'name="_continue"' not in response.content
    assert b"deletelink" not in response.content


def test_a_node_stuck_in_draining_without_a_drain_is_repaired_by_a_recorded_operator_action(operator_api):
    node, _ = make_schedulable_node()
    set_lifecycle(node, Lifecycle.DRAINING)  # e.g. its drain was deleted by the old admin

    response = act(operator_api, node, "repair-drain", {"reason": "drain row lost in an old admin delete"})

    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["lifecycle"], body["cordoned"]) == ("ready", True)
    assert [h["owner"] for h in body["holds"]] == ["user:olivia-operator"]
    event = NodeEvent.objects.get(node=node, type=fleet_events.LIFECYCLE)
    assert (event.from_state, event.to_state, event.actor_name, event.data["action"]) == (
        "draining",
        "ready",
        "olivia-operator",
        "repair-drain",
    )


def test_repair_is_refused_while_a_drain_is_active(operator_api):
    node, _ = make_schedulable_node()
    make_lease(node, "job-1")
    drain_id = act(operator_api, node, "drain", {"reason": "rack", "deadline_in": 600}).json()["id"]

    response = act(operator_api, node, "repair-drain", {"reason": "x"})

    assert response.status_code == 409
    assert (response.json()["code"], response.json()["drain_id"]) == ("drain_active", drain_id)
    assert Node.objects.get(pk=node.pk).lifecycle == Lifecycle.DRAINING


def test_repair_of_a_node_that_is_not_draining_is_409(operator_api):
    node, _ = make_schedulable_node()

    response = act(operator_api, node, "repair-drain", {"reason": "x"})

    assert response.status_code == 409
    assert response.json()["code"] == "transition_not_allowed"


def test_a_draining_node_without_a_drain_offers_repair_instead_of_cancel(operator_api):
    node, _ = make_schedulable_node()
    set_lifecycle(node, Lifecycle.DRAINING)

    allowed = act(operator_api, node, "return-to-service", {"reason": "x"}).json()["allowed_actions"]

    assert "repair-drain" in allowed and "cancel-drain" not in allowed


def test_the_admin_repairs_a_stuck_drain_through_a_form_with_a_reason(admin_client):
    node, _ = make_schedulable_node()
    set_lifecycle(node, Lifecycle.DRAINING)
    payload = {"action": "repair_stuck_drains", "apply": "1", ACTION_CHECKBOX_NAME: [str(node.pk)]}

    admin_client.post("/admin/fleet/node/", {**payload, "reason": "lost drain", f"version_{node.pk}": "1"})

    node.refresh_from_db()
    assert (node.lifecycle, node.cordoned) == ("ready", True)


def test_a_lost_node_is_not_shown_with_a_green_ready_tick(admin_client):
    node, _ = make_schedulable_node()
    # "reported" is the last status report's time (not the last renewal's)
    Node.objects.filter(pk=node.pk).update(liveness=Liveness.LOST, ready=True, last_status_report_at=timezone.now())

    page = admin_client.get("/admin/fleet/node/").content.decode()

    assert "liveness is lost" in page  # the schedulable column names why not (fleet.admin_display)
    # Readiness and health read "unknown" in grey (issue 33 item 2), the last reported value on hover.
    assert '<span class="np-badge np-muted" title="no current report; last reported ready">unknown</span>' in page
    assert '<span class="np-badge np-muted" title="no current report; last judged healthy">unknown</span>' in page
    for column in ("readiness_cell", "health_cell"):
        cell = re.search(rf'<td class="field-{column}">(.*?)</td>', page).group(1)
        assert "np-muted" in cell and "np-ok" not in cell, cell
    assert 'alt="True"' not in page  # no boolean tick anywhere in the row


def test_the_api_labels_readiness_as_reported_with_its_time_and_leads_with_schedulable(operator_api):
    node, _ = make_schedulable_node()
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(
        liveness=Liveness.LOST, ready=True, last_heartbeat_at=now, last_status_report_at=now
    )

    body = operator_api.get(f"/api/v1/nodes/{node.pk}").json()

    keys = list(body)
    assert keys.index("schedulable") < keys.index("unschedulable_reasons") < keys.index("reported_readiness")
    assert keys.index("schedulable") < keys.index("ready")
    assert body["schedulable"] is False
    assert [r["code"] for r in body["unschedulable_reasons"]] == ["not_alive"]
    assert body["reported_readiness"]["ready"] is True
    assert body["reported_readiness"]["reported_at"] is not None
