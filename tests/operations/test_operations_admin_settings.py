"""Pool operation settings changed in the admin go through the API's service: the spot taint
follows ``spot``, validation is the API's, and the version the operator saw is checked (found
while closing the round: the admin saved raw fields, so ticking "spot" skipped the taint)."""

from __future__ import annotations

import pytest

from fleet.models import Pool
from operations.models import PoolOperations
from operations.services import SPOT_TAINT
from operations.upgrade_plan import pool_operations
from tests.fleet_support import make_pool
from tests.support import staff_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def console(operator):
    return staff_client(operator)


def form_data(console, url) -> dict:
    form = console.get(url).context["adminform"].form
    data = {name: form[name].value() for name in form.fields}
    return {k: ("" if v is None else v) for k, v in data.items()}


def test_spot_ticked_in_the_admin_taints_the_pool_and_a_stale_or_bad_form_changes_nothing(console):
    pool = make_pool(name="general")
    ops = pool_operations(pool)
    url = f"/admin/operations/pooloperations/{ops.pk}/change/"
    data = form_data(console, url)

    ok = console.post(url, {**data, "spot": "on"})
    assert ok.status_code == 302, ok.context["adminform"].form.errors
    pool.refresh_from_db()
    assert any(t["key"] == SPOT_TAINT["key"] for t in pool.taints)
    assert PoolOperations.objects.get(pk=ops.pk).version == ops.version + 1

    stale = console.post(url, {**data, "spot": "on", "min_nodes": 2})  # the version of the first page
    assert stale.status_code == 200 and b"changed these settings meanwhile" in stale.content
    fresh = form_data(console, url)
    bad = console.post(url, {**fresh, "min_nodes": 5, "max_nodes": 2})
    assert bad.status_code == 200 and bad.context["adminform"].form.errors  # the model constraint max >= min
    unknown = console.post(url, {**fresh, "fallback_pool": ""} | {"provider_url": "ftp://x"})
    assert unknown.status_code == 200 and unknown.context["adminform"].form.errors["provider_url"], unknown.context[
        "adminform"
    ].form.errors
    assert PoolOperations.objects.get(pk=ops.pk).min_nodes == 0
    assert Pool.objects.get(pk=pool.pk).version == pool.version


def test_the_node_template_takes_quantities_and_survives_a_second_save(console):
    pool = make_pool(name="general")
    ops = pool_operations(pool)
    url = f"/admin/operations/pooloperations/{ops.pk}/change/"
    template = '{"resources": {"cpu": "4", "memory": "8Gi"}}'
    ok = console.post(url, {**form_data(console, url), "node_template": template})
    assert ok.status_code == 302, ok.context["adminform"].form.errors
    stored = PoolOperations.objects.get(pk=ops.pk).node_template["resources"]
    assert stored == {"cpu": 4000, "memory": 8 * 2**30}
    again = form_data(console, url)  # the canonical JSON as the page shows it, changed elsewhere
    again_ok = console.post(url, {**again, "min_nodes": 1})
    assert again_ok.status_code == 302, again_ok.context["adminform"].form.errors
    assert PoolOperations.objects.get(pk=ops.pk).node_template["resources"] == stored
    # Integers are read as the page shows them (canonical: millicores, bytes); strings as quantities.
    canonical = '{"resources": {"cpu": 2000, "memory": 8589934592}}'
    assert console.post(url, {**form_data(console, url), "node_template": canonical}).status_code == 302
    assert PoolOperations.objects.get(pk=ops.pk).node_template["resources"] == {"cpu": 2000, "memory": 8 * 2**30}
    wrong = console.post(url, {**form_data(console, url), "node_template": '{"cpus": 4}'})
    assert wrong.status_code == 200 and b"must be {resources, labels, taints, features, price}" in wrong.content


def test_upgrade_actions_ask_for_a_reason_and_act_at_the_version_the_form_showed(console, monkeypatch):
    """The admin's upgrade actions used the version re-read at submit time, so they could never
    refuse a change made since the operator looked; now they go through the intermediate form."""
    from fleet.events import Actor
    from operations import upgrades
    from operations.models import Upgrade
    from tests.operations_support import ready_pool

    monkeypatch.setattr("operations.upgrades.start_ticking", lambda upgrade: None)
    pool, _ = ready_pool("general", 2)
    actor = Actor.system("test:operator")
    upgrade = upgrades.upgrade_create(data={"pool": pool.name, "target": {"version": "2.0.0"}, "canary_nodes": 0},
                                      actor=actor)  # fmt: skip
    upgrade = upgrades.upgrade_start(upgrade_id=upgrade.pk, expected_version=upgrade.version, actor=actor)
    url = "/admin/operations/upgrade/"
    selected = {"action": "upgrade_pause", "_selected_action": [upgrade.pk]}

    form = console.post(url, selected)
    assert form.status_code == 200 and b"reason" in form.content and b"Pause" in form.content
    seen = upgrade.version
    upgrades.upgrade_pause(upgrade_id=upgrade.pk, expected_version=seen, actor=actor)  # someone else, meanwhile
    upgrades.upgrade_resume(upgrade_id=upgrade.pk, expected_version=seen + 1, actor=actor)
    stale = console.post(url, {**selected, "apply": "1", "reason": "canary looks off", f"version_{upgrade.pk}": seen},
                         follow=True)  # fmt: skip
    assert "refused" in stale.content.decode()
    assert Upgrade.objects.get(pk=upgrade.pk).state == "rolling"

    current = Upgrade.objects.get(pk=upgrade.pk).version
    done = console.post(url, {**selected, "apply": "1", "reason": "canary looks off", f"version_{upgrade.pk}": current},
                        follow=True)  # fmt: skip
    assert "done" in done.content.decode()
    assert Upgrade.objects.get(pk=upgrade.pk).state == "paused"


def test_the_pool_page_shows_budgets_windows_and_blocked_disruptions_and_checks_a_new_budget(console):
    from django.utils import timezone

    from operations.disruption import record_blocked
    from tests.factories import make_schedulable_node

    pool = make_pool(name="general")
    node, _ = make_schedulable_node(pool, hostname="cpu-1")
    ops = pool_operations(pool)
    url = f"/admin/operations/pooloperations/{ops.pk}/change/"
    window = '[{"nodes": "10%"}, {"nodes": "0", "reasons": ["upgrade"], "schedule": "0 9 * * 1-5", "duration": "8h"}]'
    ok = console.post(url, {**form_data(console, url), "disruption_budgets": window})
    assert ok.status_code == 302, ok.context["adminform"].form.errors
    record_blocked(node=node, reason="upgrade", owner="system:upgrade", now=timezone.now(),
                   blocker={"kind": "window", "detail": "blackout window: pool budget #1"})  # fmt: skip

    page = console.get(url).content.decode()
    assert "0 9 * * 1-5 for 8h (UTC)" in page and "scale_down: 1" in page
    assert "cpu-1 (upgrade): blackout window: pool budget #1" in page

    bad = console.post(url, {**form_data(console, url), "disruption_budgets": '[{"nodes": "150%"}]'})
    assert bad.status_code == 200 and bad.context["adminform"].form.errors
    assert len(PoolOperations.objects.get(pk=ops.pk).disruption_budgets) == 2


def test_the_pool_page_sets_expiry_shows_drift_and_refuses_a_bad_expire_after(console):
    from fleet.models import Pool
    from operations import replacement_sweep
    from tests.factories import make_schedulable_node

    pool = make_pool(name="general")
    make_schedulable_node(pool, hostname="cpu-1")
    ops = pool_operations(pool)
    url = f"/admin/operations/pooloperations/{ops.pk}/change/"
    ok = console.post(url, {**form_data(console, url), "expire_after": "86400", "termination_grace": "3600"})
    assert ok.status_code == 302, ok.context["adminform"].form.errors
    assert (
        PoolOperations.objects.get(pk=ops.pk).expire_after,
        PoolOperations.objects.get(pk=ops.pk).termination_grace,
    ) == (86400, 3600)
    replacement_sweep.sweep_pool(pool=pool)
    Pool.objects.filter(pk=pool.pk).update(taints=[{"key": "gpu", "value": "", "effect": "NoSchedule"}])
    replacement_sweep.sweep_pool(pool=Pool.objects.get(pk=pool.pk))

    page = console.get(url).content.decode()
    assert "Drift and expiry" in page and "cpu-1: PoolShapeChanged" in page
    assert "cpu-1 (drift)" in page

    bad = console.post(url, {**form_data(console, url), "expire_after": "30"})
    assert bad.status_code == 200 and "expire_after" in bad.context["adminform"].form.errors
    assert PoolOperations.objects.get(pk=ops.pk).expire_after == 86400
