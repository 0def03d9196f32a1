"""Bootstrap tokens naming a node: an agent takes the node over and keeps its identity (fleet.takeover)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.admission import AGENT_MISSING, check_agent_version
from fleet.events import Actor
from fleet.k8s_import import import_nodes
from fleet.models import BootstrapToken, Node, NodeCredential, NodeEvent
from fleet.services import bootstrap_token_create, node_enroll
from nodepool.api.problems import Problem
from tests.factories import PoolFactory, make_schedulable_node, set_lifecycle
from tests.fleet.test_k8s_import import FIXTURES
from tests.fleet_support import enroll, enrollment, make_pool
from tests.heartbeat_support import post_beat
from tests.problems import assert_problem
from tests.races import race
from tests.support import node_api, staff_client

TOKENS = "/api/v1/bootstrap-tokens"
ENROLL = "/api/v1/node-enrollments"


def node_token(node, *, ttl: int = 3600) -> str:
    _, secret = bootstrap_token_create(pool=None, node_id=node.pk, expires_at=timezone.now() + timedelta(seconds=ttl))
    return secret


@pytest.fixture
def node_and_secret(db):
    return make_schedulable_node(PoolFactory(name="general"))


# --- creating a token naming a node ---------------------------------------------------------------


def test_an_operator_creates_a_token_naming_a_node_in_the_nodes_pool(operator_api, node_and_secret):
    node, _ = node_and_secret
    response = operator_api.post(TOKENS, {"node": str(node.pk), "ttl_seconds": 600}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["node"], body["pool"], body["max_uses"]) == (str(node.pk), "general", 1)
    assert body["token"].startswith("npb_")
    assert BootstrapToken.objects.get().node_id == node.pk


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"node": "00000000-0000-4000-8000-000000000000"}, 400, "unknown_node"),
        ({"node": "not-a-uuid"}, 400, "unknown_node"),
        ({"node": "{node}", "max_uses": 2}, 400, "invalid_max_uses"),
        ({"node": "{node}", "pool": "other"}, 400, "node_pool_mismatch"),
        ({"node": "{node}", "owner": "operator"}, 400, None),
        ({"description": "neither pool nor node"}, 400, None),
    ],
)
def test_a_bad_token_request_is_a_problem_and_creates_nothing(operator_api, node_and_secret, body, status, code):
    node, _ = node_and_secret
    PoolFactory(name="other")
    body = {k: (v.format(node=node.pk) if isinstance(v, str) else v) for k, v in body.items()}
    assert_problem(operator_api.post(TOKENS, body, format="json"), status, code)
    assert BootstrapToken.objects.count() == 0


@pytest.mark.parametrize(("lifecycle", "status", "code"), [("quarantined", 409, "node_quarantined"),
                                                          ("retired", 410, "node_retired")])  # fmt: skip
def test_no_token_names_a_quarantined_or_retired_node(operator_api, node_and_secret, lifecycle, status, code):
    node, _ = node_and_secret
    set_lifecycle(node, lifecycle)
    assert_problem(operator_api.post(TOKENS, {"node": str(node.pk)}, format="json"), status, code)
    assert BootstrapToken.objects.count() == 0


# --- taking a node over ---------------------------------------------------------------------------


def test_an_agent_with_a_token_naming_its_node_reenrolls_as_the_same_node(anon_api, node_and_secret):
    node, old_secret = node_and_secret
    secret = node_token(node)

    response = enroll(anon_api, secret, node=str(node.pk), hostname="renamed")

    assert response.status_code == 201, response.content
    body = response.json()
    assert body["node_id"] == str(node.pk) and body["incarnation"] == node.incarnation + 1
    assert Node.objects.count() == 1
    stored = Node.objects.get()
    assert (stored.lifecycle, stored.hostname, stored.incarnation) == ("ready", node.hostname, node.incarnation + 1)
    # The old lineage is revoked, the new credential works and starts the new incarnation.
    assert_problem(post_beat(node_api(old_secret), node, sequence=1, incarnation=node.incarnation + 1), 401)
    beat = post_beat(node_api(body["credential"]), node, sequence=1, incarnation=body["incarnation"])
    assert beat.status_code == 200 and beat.json()["code"] == "applied", beat.content
    assert NodeCredential.objects.filter(node=node, revoked_at__isnull=True).count() == 1
    event = NodeEvent.objects.get(node=node, type="taken_over")
    assert event.data["credentials_revoked"] == 1 and event.data["capability_redeclared"] is False
    assert BootstrapToken.objects.get().uses == 1


def test_a_node_taken_over_keeps_its_devices_and_is_no_duplicate_claimer(anon_api, node_and_secret):
    node, _ = node_and_secret
    gpu = {"id": "GPU-11111111-2222-3333-4444-555555555555", "type": "nvidia.com/gpu", "index": 0,
           "model": "NVIDIA H100 80GB HBM3", "memory": 80 * 2**30}  # fmt: skip
    first = enroll(anon_api, node_token(node), node=str(node.pk), devices=[gpu], boot_id="boot-1")
    assert first.status_code == 201, first.content
    again = enroll(anon_api, node_token(node), node=str(node.pk), devices=[gpu], boot_id="boot-2")
    assert again.status_code == 201, again.content

    node.refresh_from_db()
    assert node.lifecycle == "ready"  # not quarantined by device_identity_conflict
    live = node.devices.filter(retired_at__isnull=True)
    assert [d.device_id for d in live] == [gpu["id"]]
    assert not NodeEvent.objects.filter(node=node, type="device", to_state="conflict").exists()


@pytest.mark.parametrize("lifecycle", ["quarantined", "retired"])
def test_a_token_naming_a_node_later_quarantined_or_retired_spends_nothing(anon_api, node_and_secret, lifecycle):
    node, _ = node_and_secret
    secret = node_token(node)
    set_lifecycle(node, lifecycle)
    status, code = {"quarantined": (409, "node_quarantined"), "retired": (410, "node_retired")}[lifecycle]
    assert_problem(enroll(anon_api, secret, node=str(node.pk)), status, code)
    assert BootstrapToken.objects.get().uses == 0
    assert NodeCredential.objects.filter(node=node, revoked_at__isnull=True).count() == 1


def test_the_body_naming_a_node_needs_a_token_naming_that_very_node(anon_api, node_and_secret):
    node, _ = node_and_secret
    other, _ = make_schedulable_node(node.pool)
    _, general = bootstrap_token_create(pool=node.pool, expires_at=timezone.now() + timedelta(hours=1))
    assert_problem(enroll(anon_api, general, node=str(node.pk)), 403, "bootstrap_token_wrong_node")
    assert_problem(enroll(anon_api, node_token(other), node=str(node.pk)), 403, "bootstrap_token_wrong_node")
    assert_problem(anon_api.post(ENROLL, enrollment(general, node="nope"), format="json"), 400)
    assert set(BootstrapToken.objects.values_list("uses", flat=True)) == {0}
    assert Node.objects.count() == 2


def test_a_token_naming_a_node_is_used_once_and_expires(anon_api, node_and_secret, time_machine):
    node, _ = node_and_secret
    secret = node_token(node, ttl=120)
    assert enroll(anon_api, secret, node=str(node.pk)).status_code == 201
    assert_problem(enroll(anon_api, secret, node=str(node.pk)), 403, "bootstrap_token_exhausted")
    late = node_token(node, ttl=120)
    time_machine.move_to(timezone.now() + timedelta(seconds=600))
    assert_problem(enroll(anon_api, late, node=str(node.pk)), 403, "bootstrap_token_expired")
    assert NodeEvent.objects.filter(node=node, type="taken_over").count() == 1


# --- imported Kubernetes nodes --------------------------------------------------------------------


def test_an_imported_node_says_no_agent_is_there_until_an_agent_takes_it_over(anon_api, db):
    pool = make_pool(name="imported")
    report = import_nodes(
        text=(FIXTURES / "nodelist-3-workers-aks.json").read_text(), pool=pool, actor=Actor.system("test")
    )
    assert len(report.created) == 3
    node = Node.objects.order_by("display_name").first()
    outcome = check_agent_version(node, pool)
    assert outcome.status == "failed" and outcome.data["code"] == AGENT_MISSING
    assert "no agent runs on this node" in outcome.detail and str(node.pk) in outcome.detail

    # The agent does not know the node's id: the token alone names it.
    response = enroll(anon_api, node_token(node), hostname="aks-worker-0", agent_version="1.4.0")

    assert response.status_code == 201, response.content
    assert response.json()["node_id"] == str(node.pk) and response.json()["lifecycle"] == "pending"
    assert Node.objects.count() == 3
    node.refresh_from_db()
    assert (node.hostname, node.agent_version, node.external_id.startswith("k8s:")) == ("aks-worker-0", "1.4.0", True)
    assert node.declared["resources"]["cpu"] == 8000  # what the agent declared, for admission to verify
    assert check_agent_version(node, pool).status == "passed"
    assert NodeEvent.objects.get(node=node, type="taken_over").data["capability_redeclared"] is True


# --- the race -------------------------------------------------------------------------------------


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_agents_racing_with_one_token_naming_a_node_have_exactly_one_winner():
    node, _ = make_schedulable_node(PoolFactory(name="general"))
    secret = node_token(node)

    def attempt(index: int):
        try:
            enrolled, _, credential = node_enroll(
                bootstrap_token=secret,
                expected_node=str(node.pk),
                hostname=f"racer-{index}",
                agent_version="1.0.0",
                capability={"resources": {"cpu": 1000, "memory": 2**30}},
            )
            return ("won", str(enrolled.pk))
        except Problem as exc:
            return exc.get_codes()

    outcome = race(attempt, 4)

    assert not outcome.errors, outcome.errors
    assert outcome.count(("won", str(node.pk))) == 1, outcome.results
    assert outcome.count("bootstrap_token_exhausted") == 3, outcome.results
    assert Node.objects.count() == 1
    assert NodeCredential.objects.filter(node=node, revoked_at__isnull=True).count() == 1
    assert Node.objects.get().incarnation == node.incarnation + 1
    assert NodeEvent.objects.filter(node=node, type="taken_over").count() == 1


def test_a_reimport_leaves_a_node_an_agent_took_over_alone(anon_api, db):
    pool = make_pool(name="imported")
    text = (FIXTURES / "nodelist-3-workers-aks.json").read_text()
    import_nodes(text=text, pool=pool, actor=Actor.system("test"))
    node = Node.objects.order_by("display_name").first()
    assert enroll(anon_api, node_token(node), hostname="aks-worker-0").status_code == 201
    before = Node.objects.get(pk=node.pk)

    report = import_nodes(text=text, pool=pool, actor=Actor.system("test"))

    assert any("an agent took this node over" in line for line in report.skipped), report.skipped
    after = Node.objects.get(pk=node.pk)
    assert (after.hostname, after.declared, after.version) == ("aks-worker-0", before.declared, before.version)


def test_the_admin_action_gives_each_selected_node_a_token_naming_it(operator, node_and_secret, anon_api):
    node, _ = node_and_secret
    browser = staff_client(operator)
    response = browser.post(
        "/admin/fleet/node/", {"action": "allow_takeover", "_selected_action": [node.pk]}, follow=True
    )

    assert response.status_code == 200
    (message,) = [str(m) for m in response.context["messages"]]
    secret = message.rsplit(" ", 1)[-1]
    token = BootstrapToken.objects.get()
    assert (token.node_id, token.max_uses, secret.startswith("npb_")) == (node.pk, 1, True)
    assert enroll(anon_api, secret, node=str(node.pk)).json()["node_id"] == str(node.pk)


def test_an_agent_taking_over_an_imported_node_brings_its_attestation_for_admission(anon_api, db):
    from fleet.admission import check_attestation
    from tests.fleet_support import Signer

    signer = Signer()
    pool = make_pool(name="imported", attestation_required=True, attestation_public_key=signer.public_pem)
    import_nodes(text=(FIXTURES / "nodelist-3-workers-aks.json").read_text(), pool=pool, actor=Actor.system("t"))
    node = Node.objects.order_by("display_name").first()
    assert check_attestation(node, pool).status == "failed"  # imported: nothing attested

    evidence = signer.attest({"hostname": "aks-worker-0", "pool": "imported"})
    response = enroll(anon_api, node_token(node), hostname="aks-worker-0", attestation=evidence)

    assert response.status_code == 201, response.content
    node.refresh_from_db()
    assert check_attestation(node, pool).status == "passed"
