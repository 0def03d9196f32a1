"""The operators' console (Django test client): the node list at a glance, its filters, the node
page in sections, actions from the node page, the drain form's relative deadline and dry run."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Group, User
from django.utils import timezone

from fleet.models import Node, NodeResource
from leases.models import Lease
from maintenance.models import Drain
from nodepool.api.permissions import OWNERS
from tests.factories import NodeFactory, PoolFactory, make_schedulable_node, place_test_hold
from tests.maintenance_support import make_lease

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/fleet/node/"


def listed(client, **params) -> list[str]:
    return [str(node) for node in client.get(CHANGELIST, params).context["cl"].result_list]


def page_of(client, node) -> str:
    return client.get(f"{CHANGELIST}{node.pk}/change/").content.decode()


def test_the_node_list_sorts_by_pool_then_hostname(admin_client):
    make_schedulable_node(PoolFactory(name="zeta"), hostname="a-node")
    make_schedulable_node(PoolFactory(name="alpha"), hostname="z-node")
    make_schedulable_node(PoolFactory(name="alpha"), hostname="m-node")

    assert listed(admin_client) == ["m-node", "z-node", "a-node"]


def test_the_node_list_shows_schedulable_with_the_first_reason_and_free_capacity(admin_client):
    node, _ = make_schedulable_node(hostname="rack1-n1", resources={"cpu": 8000, "memory": 32 * 2**30})
    NodeResource.objects.filter(node=node, name="cpu").update(allocated=1500)
    place_test_hold(make_schedulable_node(hostname="rack1-n2")[0], "user:olivia", "bios update")

    content = admin_client.get(CHANGELIST).content.decode()

    assert "6.5 cpu · 32Gi" in content
    assert "cordoned by user:olivia (bios update)" in content
    assert content.count('class="np-badge np-ok" title="">yes</span>') == 1
    assert str(node.pk)[:8] in content and f'data-copy="{node.pk}"' in content


def test_the_schedulable_and_reason_filters_agree_with_the_reasons(admin_client):
    make_schedulable_node(hostname="good")
    place_test_hold(make_schedulable_node(hostname="cordoned")[0])
    Node.objects.filter(pk=make_schedulable_node(hostname="lost")[0].pk).update(liveness="lost")

    assert listed(admin_client, schedulable="yes") == ["good"]
    assert sorted(listed(admin_client, schedulable="no")) == ["cordoned", "lost"]
    assert listed(admin_client, unschedulable="not_alive") == ["lost"]
    assert listed(admin_client, unschedulable="cordoned") == ["cordoned"]
    assert listed(admin_client, unschedulable="lifecycle_not_ready") == []


def test_the_owner_filter_offers_owners_only(admin_client):
    owner = User.objects.create_user("oscar-owner")
    owner.groups.add(Group.objects.get_or_create(name=OWNERS)[0])
    User.objects.create_user("carla-client")
    NodeFactory(owner=owner)

    spec = next(f for f in admin_client.get(CHANGELIST).context["cl"].filter_specs if f.title == "owner")
    assert [name for _, name in spec.lookup_choices] == ["oscar-owner"]


def test_the_node_page_has_sections_in_human_units_and_leases_inline(admin_client):
    node, _ = make_schedulable_node(hostname="gpu-7", resources={"cpu": 8000, "memory": 25276063744})
    Node.objects.filter(pk=node.pk).update(
        declared={"resources": {"cpu": 8000, "memory": 25276063744}},
        conditions=[{"type": "DiskPressure", "status": "True", "reason": "KubeletHasDiskPressure", "message": ""}],
    )
    make_lease(node, "train-42", resources={"cpu": 2000})

    content = page_of(admin_client, node)

    for section in ("summary", "actions", "capability", "resources", "conditions", "leases", "maintenance", "events"):
        assert f'id="section-{section}"' in content, section
    assert "23.5Gi" in content and "25276063744" not in content
    assert "KubeletHasDiskPressure" in content
    assert "train-42" in content and "/admin/leases/lease/" in content
    assert "artifacts blocked</th><td>no" in content


def test_an_action_from_the_node_page_returns_to_it_and_keeps_the_hostname_as_written(admin_client):
    node, _ = make_schedulable_node(hostname="rack9-n1")
    back = f"{CHANGELIST}{node.pk}/change/"
    response = admin_client.post(
        CHANGELIST,
        {"action": "cordon_nodes", "apply": "1", ACTION_CHECKBOX_NAME: [str(node.pk)],
         f"version_{node.pk}": str(node.version), "reason": "bios update", "_node_page": back},
        follow=True,
    )  # fmt: skip

    assert response.redirect_chain[-1][0] == back
    assert "Cordon (your own hold) done for rack9-n1." in response.content.decode()
    node.refresh_from_db()
    assert node.cordoned and node.holds.get().owner == "user:ada-admin"


def test_a_stale_version_from_the_node_page_is_refused_and_changes_nothing(admin_client):
    node, _ = make_schedulable_node(hostname="rack9-n2")
    Node.objects.filter(pk=node.pk).update(version=node.version + 1)  # someone acted meanwhile
    response = admin_client.post(
        CHANGELIST,
        {"action": "cordon_nodes", "apply": "1", ACTION_CHECKBOX_NAME: [str(node.pk)],
         f"version_{node.pk}": str(node.version), "reason": "bios update"},
        follow=True,
    )  # fmt: skip

    assert "Cordon (your own hold) refused for rack9-n2:" in response.content.decode()
    assert Node.objects.get(pk=node.pk).cordoned is False


def test_the_redirect_back_goes_only_to_node_pages(admin_client):
    node, _ = make_schedulable_node()
    response = admin_client.post(
        CHANGELIST,
        {"action": "cordon_nodes", "apply": "1", ACTION_CHECKBOX_NAME: [str(node.pk)],
         f"version_{node.pk}": str(node.version), "reason": "r", "_node_page": "https://evil.example/"},
    )  # fmt: skip
    assert response.status_code == 302 and response["Location"] == CHANGELIST


def drain_post(client, node, **fields):
    data = {"action": "drain_nodes", ACTION_CHECKBOX_NAME: [str(node.pk)], f"version_{node.pk}": str(node.version),
            "reason": "kernel update", "policy": "checkpoint", **fields}  # fmt: skip
    return client.post(CHANGELIST, data, follow=True)


def test_the_drain_preview_shows_the_plan_and_changes_nothing(admin_client):
    node, _ = make_schedulable_node(hostname="rack2-n1")
    make_lease(node, "job-a")

    response = drain_post(admin_client, node, preview="1", deadline_in="2", deadline_unit="hours")

    content = response.content.decode()
    assert "Dry run" in content and "job-a" in content and "checkpoint" in content
    assert not Drain.objects.exists()
    assert Node.objects.get(pk=node.pk).lifecycle == "ready"


def test_a_drain_with_a_relative_deadline_starts_with_that_deadline(admin_client):
    node, _ = make_schedulable_node()
    before = timezone.now()

    drain_post(admin_client, node, apply="1", deadline_in="90", deadline_unit="minutes")

    drain = Drain.objects.get(node=node)
    assert before + timedelta(minutes=89) < drain.deadline < timezone.now() + timedelta(minutes=91)
    assert (drain.policy, drain.reason) == ("checkpoint", "kernel update")


def test_a_drain_needs_exactly_one_kind_of_deadline(admin_client):
    node, _ = make_schedulable_node()

    neither = drain_post(admin_client, node, apply="1")
    both = drain_post(admin_client, node, apply="1", deadline_in="1", deadline="2099-01-01T00:00")

    for response in (neither, both):
        assert "Give a deadline" in response.content.decode()
    assert not Drain.objects.exists()


def test_a_drain_at_a_picked_date_and_time(admin_client):
    node, _ = make_schedulable_node()
    at = (timezone.now() + timedelta(hours=3)).replace(second=0, microsecond=0)

    drain_post(admin_client, node, apply="1", deadline=at.strftime("%Y-%m-%dT%H:%M"))

    assert Drain.objects.get(node=node).deadline == at


def test_a_revoked_lease_no_longer_says_its_workload_is_running(admin_client):
    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-r")
    Lease.objects.filter(pk=lease.pk).update(workload_state="running")

    admin_client.post("/admin/leases/lease/", {"action": "revoke", ACTION_CHECKBOX_NAME: [str(lease.pk)]})

    lease.refresh_from_db()
    assert (lease.state, lease.workload_state) == ("revoked", "unknown")


def test_an_ended_lease_keeps_a_reported_checkpoint(admin_client):
    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-c")
    Lease.objects.filter(pk=lease.pk).update(workload_state="checkpointed")

    admin_client.post("/admin/leases/lease/", {"action": "revoke", ACTION_CHECKBOX_NAME: [str(lease.pk)]})

    assert Lease.objects.get(pk=lease.pk).workload_state == "checkpointed"


def test_uncordon_from_the_node_page_offers_the_holds_there_are(admin_client):
    node, _ = make_schedulable_node(hostname="rack9-n3")
    place_test_hold(node, "user:olivia", "disk swap")
    place_test_hold(node, "user:ada-admin", "bios update")

    content = page_of(admin_client, node)

    assert '<option value="user:ada-admin">yours (user:ada-admin)</option>' in content
    assert '<option value="user:olivia">user:olivia</option>' in content
    assert "Force: remove another actor" in content
    assert "disk swap" in content  # the holds, listed in the maintenance section


def test_uncordon_of_another_actors_hold_needs_force_and_keeps_ones_own(admin_client):
    node, _ = make_schedulable_node(hostname="rack9-n4")
    place_test_hold(node, "user:olivia", "disk swap")
    place_test_hold(node, "user:ada-admin", "bios update")
    node.refresh_from_db()

    def uncordon(**extra):
        data = {"action": "uncordon_nodes", "apply": "1", ACTION_CHECKBOX_NAME: [str(node.pk)], "reason": "done",
                f"version_{node.pk}": str(Node.objects.get(pk=node.pk).version), **extra}  # fmt: skip
        return admin_client.post(CHANGELIST, data, follow=True).content.decode()

    assert "refused for rack9-n4" in uncordon(owner="user:olivia")
    assert "done for rack9-n4" in uncordon(owner="user:olivia", force="on")
    assert [h.owner for h in node.holds.filter(removed_at__isnull=True)] == ["user:ada-admin"]
