import re
from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.choices import Lifecycle
from fleet.models import AdmissionCheck, BootstrapToken, Node, Pool
from fleet.secrets import hash_secret
from tests.factories import NodeFactory, set_lifecycle
from tests.fleet_support import make_pool
from tests.support import staff_client

pytestmark = pytest.mark.django_db
SOON = (timezone.now() + timedelta(days=30)).date().isoformat()


_login = staff_client


@pytest.fixture
def operator_browser(operator):
    return _login(operator)


@pytest.fixture
def owner_browser(owner):
    return _login(owner)


def test_operator_sees_the_node_page_in_sections_with_inlines(operator_browser):
    node = NodeFactory(hostname="rack4-n1")
    assert operator_browser.get("/admin/fleet/node/").status_code == 200
    content = operator_browser.get(f"/admin/fleet/node/{node.pk}/change/").content.decode()
    assert "rack4-n1" in content and "Admission checks" not in content  # empty record tables left off
    AdmissionCheck.objects.create(node=node, name="agent_version", status="passed", attempt=1)
    page = operator_browser.get(f"/admin/fleet/node/{node.pk}/change/")
    assert page.status_code == 200
    content = page.content.decode()
    assert "Admission checks" in content
    for section in ("summary", "capability", "resources", "conditions", "events"):
        assert f'id="section-{section}"' in content


def test_node_search_by_id_hostname_and_label(operator_browser):
    a = NodeFactory(hostname="alpha", labels={"zone": "a"})
    b = NodeFactory(hostname="beta", node_labels={"gpu": "a16"})

    def found(term):
        return operator_browser.get("/admin/fleet/node/", {"q": term}).context["cl"].result_count

    assert found("alpha") == 1
    assert found(str(b.pk)) == 1
    assert found("zone=a") == 1
    assert found("gpu=a16") == 1
    assert found("zone=b") == 0
    assert found("bad key!=x") == 0
    assert a.pk != b.pk


def test_admin_admit_action_respects_the_version(operator_browser, django_capture_on_commit_callbacks):
    fresh = NodeFactory()
    moved = NodeFactory()
    confirm = operator_browser.post(
        "/admin/fleet/node/", {"action": "admit_nodes", "_selected_action": [fresh.pk, moved.pk]}
    )
    assert confirm.status_code == 200
    assert b"Admit nodes" in confirm.content
    Node.objects.filter(pk=moved.pk).update(version=5)  # someone acted meanwhile
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_browser.post(
            "/admin/fleet/node/",
            {
                "action": "admit_nodes",
                "_selected_action": [fresh.pk, moved.pk],
                "confirm": "yes",
                "reason": "checked the rack",
                f"version_{fresh.pk}": "1",
                f"version_{moved.pk}": "1",
            },
            follow=True,
        )
    assert response.status_code == 200
    assert Node.objects.get(pk=fresh.pk).lifecycle == Lifecycle.READY
    assert Node.objects.get(pk=moved.pk).lifecycle == Lifecycle.PENDING
    text = response.content.decode()
    assert "version 5" in text


def test_admin_creates_a_bootstrap_token_and_shows_the_secret_once(operator_browser):
    pool = make_pool(name="general")
    response = operator_browser.post(
        "/admin/fleet/bootstraptoken/add/",
        {"pool": pool.pk, "description": "rack 4", "expires_at_0": SOON, "expires_at_1": "00:00:00",
         "max_uses": 3},
        follow=True,
    )  # fmt: skip
    assert response.status_code == 200
    match = re.search(r"(npb_[0-9a-f]{12}\.[A-Za-z0-9_\-]+)", response.content.decode())
    assert match, response.content.decode()[:2000]
    token = BootstrapToken.objects.get()
    assert token.secret_hash == hash_secret(match.group(1))
    again = operator_browser.get(f"/admin/fleet/bootstraptoken/{token.pk}/change/").content.decode()
    assert match.group(1) not in again


def test_admin_refuses_a_marketplace_token_without_owner(operator_browser):
    pool = make_pool(name="market", kind="marketplace")
    response = operator_browser.post(
        "/admin/fleet/bootstraptoken/add/",
        {"pool": pool.pk, "expires_at_0": SOON, "expires_at_1": "00:00:00", "max_uses": 1},
    )
    assert response.status_code == 200
    assert b"must name its owner" in response.content
    assert BootstrapToken.objects.count() == 0


def test_admin_pool_change_checks_version_and_timings(operator_browser):
    pool = make_pool(name="general")
    url = f"/admin/fleet/pool/{pool.pk}/change/"
    form = operator_browser.get(url).context["adminform"].form
    data = {k: v for k, v in form.initial.items() if v is not None}
    for name in ("labels", "taints", "reservations", "required_capabilities", "required_labels",
                 "unhealthy_conditions", "degraded_conditions"):  # fmt: skip
        data[name] = form[name].value()
    data.update({"expected_version": 1, "reservations": '{"system": {"cpu": "500m"}}'})
    ok = operator_browser.post(url, data)
    assert ok.status_code == 302, ok.context["adminform"].form.errors
    pool.refresh_from_db()
    assert pool.reservations == {"system": {"cpu": 500}} and pool.version == 2
    stale = operator_browser.post(url, {**data, "description": "again"})
    assert stale.status_code == 200 and b"changed this pool meanwhile" in stale.content
    bad = operator_browser.post(url, {**data, "expected_version": 2, "heartbeat_grace": 5})
    assert bad.status_code == 200 and b"twice the heartbeat interval" in bad.content
    assert Pool.objects.get().version == 2


def test_owner_admin_is_read_only_and_limited_to_their_nodes(owner_browser, owner, other_owner):
    mine = set_lifecycle(NodeFactory(owner=owner, hostname="mine"), "quarantined")
    theirs = NodeFactory(owner=other_owner, hostname="theirs")
    listing = owner_browser.get("/admin/fleet/node/")
    assert listing.status_code == 200
    assert listing.context["cl"].result_count == 1
    page = owner_browser.get(f"/admin/fleet/node/{mine.pk}/change/")
    assert page.status_code == 200
    assert b"Credentials" not in page.content and b"quarantined" in page.content
    assert owner_browser.get(f"/admin/fleet/node/{theirs.pk}/change/").status_code != 200
    assert owner_browser.get("/admin/fleet/pool/").status_code == 403
    assert owner_browser.get("/admin/fleet/bootstraptoken/").status_code == 403
    response = owner_browser.post(
        "/admin/fleet/node/", {"action": "admit_nodes", "_selected_action": [mine.pk], "confirm": "yes"}
    )
    assert Node.objects.get(pk=mine.pk).lifecycle == Lifecycle.QUARANTINED
    assert response.status_code in (200, 302)


def test_node_page_shows_only_the_most_recent_events(operator_browser):
    from fleet.admin_display import TIMELINE_EVENTS as RECENT_EVENTS_INLINE
    from fleet.events import Actor, record_event

    node = NodeFactory()
    for i in range(RECENT_EVENTS_INLINE + 5):
        record_event(node, "policy", Actor.system("t"), reason=f"event-{i:03d}")
    page = operator_browser.get(f"/admin/fleet/node/{node.pk}/change/").content.decode()
    assert f"event-{RECENT_EVENTS_INLINE + 4:03d}" in page
    assert "event-000" not in page

    few = NodeFactory()
    record_event(few, "policy", Actor.system("t"), reason="only-one")
    assert "only-one" in operator_browser.get(f"/admin/fleet/node/{few.pk}/change/").content.decode()
