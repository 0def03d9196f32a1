import pytest

from fleet import admission
from fleet import event_types as fleet_events
from fleet.choices import CheckStatus, Lifecycle, PoolKind
from fleet.events import Actor
from fleet.models import AdmissionCheck, Node, NodeEvent, NodeResource
from tests.factories import NodeFactory
from tests.fleet_support import Signer, enroll, fresh_throttles, make_pool, make_token  # noqa: F401
from tests.races import race

pytestmark = pytest.mark.usefixtures("fresh_throttles")
SYSTEM = Actor.system("test")


def _admit(api, node, **body):
    return api.post(f"/api/v1/nodes/{node.pk}/admit", body, format="json", HTTP_IF_MATCH=f'"{node.version}"')


def _checks(node) -> dict[str, AdmissionCheck]:
    return {c.name: c for c in AdmissionCheck.objects.filter(node=node, attempt=node.admission_attempt)}


@pytest.mark.django_db
def test_admitted_node_becomes_ready_with_verified_capability_and_inventory(
    operator_api, django_capture_on_commit_callbacks
):
    pool = make_pool(reservations={"system": {"cpu": 500, "memory": 2**30}})
    node = NodeFactory(pool=pool)

    with django_capture_on_commit_callbacks(execute=True):
        response = _admit(operator_api, node, reason="rack 4 is wired")

    assert response.status_code == 202, response.json()
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.READY
    assert node.verified["resources"] == node.declared["resources"]
    cpu = NodeResource.objects.get(node=node, name="cpu")
    assert (cpu.capacity, cpu.reserved, cpu.allocatable, cpu.allocated) == (8000, 500, 7500, 0)
    checks = _checks(node)
    assert set(checks) == {"agent_version", "capabilities", "labels", "plausibility", "attestation", "pool_shape"}
    assert checks["attestation"].status == CheckStatus.SKIPPED
    assert all(c.status == CheckStatus.PASSED for n, c in checks.items() if n != "attestation")
    assert all(c.started_at and c.finished_at for c in checks.values())
    transitions = NodeEvent.objects.filter(node=node, type=fleet_events.LIFECYCLE).order_by("id")
    assert [(e.from_state, e.to_state) for e in transitions] == [("pending", "admitting"), ("admitting", "ready")]
    assert transitions[0].actor_name == "olivia-operator" and transitions[0].reason == "rack 4 is wired"


@pytest.mark.django_db
def test_admit_needs_the_current_version(operator_api):
    node = NodeFactory()
    url = f"/api/v1/nodes/{node.pk}/admit"
    assert operator_api.post(url, {}, format="json").status_code == 428
    assert operator_api.post(url, {}, format="json", HTTP_IF_MATCH='"5"').status_code == 412
    assert operator_api.post(url, {}, format="json", HTTP_IF_MATCH="garbage").json()["code"] == "invalid_if_match"
    assert operator_api.post(url, {"bogus": 1}, format="json", HTTP_IF_MATCH='"1"').status_code == 400
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.PENDING and node.version == 1


@pytest.mark.django_db
def test_admitting_a_ready_node_is_a_conflict(operator_api, django_capture_on_commit_callbacks):
    node = NodeFactory()
    with django_capture_on_commit_callbacks(execute=True):
        _admit(operator_api, node)
    node.refresh_from_db()
    response = _admit(operator_api, node)
    assert response.status_code == 409
    assert response.json()["code"] == "transition_not_allowed"


@pytest.mark.django_db
def test_admitting_an_unknown_node_is_404(operator_api):
    response = operator_api.post(
        "/api/v1/nodes/00000000-0000-0000-0000-000000000000/admit", {}, format="json", HTTP_IF_MATCH='"1"'
    )
    assert response.status_code == 404


@pytest.mark.django_db
def test_only_operators_admit(client_api, owner_api, owner):
    node = NodeFactory(owner=owner)
    for api in (client_api, owner_api):
        assert _admit(api, node).status_code == 403
    assert Node.objects.get().lifecycle == Lifecycle.PENDING


@pytest.mark.django_db
def test_every_failed_check_is_visible_on_a_rejected_node(operator_api, django_capture_on_commit_callbacks):
    pool = make_pool(
        allowed_agent_versions=">=2",
        required_capabilities={"resources": {"memory": 64 * 2**30}, "features": {"arch": "arm64"}},
        required_labels={"zone": "*"},
    )
    node = NodeFactory(pool=pool, agent_version="1.4.0")
    with django_capture_on_commit_callbacks(execute=True):
        _admit(operator_api, node)
    body = operator_api.get(f"/api/v1/nodes/{node.pk}").json()
    assert body["lifecycle"] == "rejected"
    failed = {f["name"] for f in body["admission"]["failed"]}
    assert failed == {"agent_version", "capabilities", "labels"}
    assert "agent version 1.4.0 is outside the allowed >=2" in body["lifecycle_reason"]
    assert "arm64" in body["lifecycle_reason"] and "zone is missing" in body["lifecycle_reason"]
    assert NodeResource.objects.filter(node=node).count() == 0
    assert Node.objects.get().verified == {}


@pytest.mark.django_db
@pytest.mark.parametrize(
    "resources, accelerators, expected",
    [
        ({"cpu": 2_000_000, "memory": 2**30}, [], "cpu 2000000 exceeds"),
        ({"cpu": 8000, "memory": 65 * 2**40}, [], "memory"),
        ({"cpu": -1, "memory": 2**30}, [], "cpu is negative"),
        ({"cpu": 8000, "memory": 2**30, "nvidia.com/gpu": 2}, [], "without any accelerator"),
        ({"cpu": 8000}, [], "memory is missing"),
    ],
)
def test_implausible_capability_is_rejected(resources, accelerators, expected, django_capture_on_commit_callbacks):
    node = NodeFactory(declared={"resources": resources, "accelerators": accelerators})
    from fleet.services import node_admit

    with django_capture_on_commit_callbacks(execute=True):
        node_admit(node_id=node.pk, expected_version=1, actor=SYSTEM)
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.REJECTED
    assert _checks(node)["plausibility"].status == CheckStatus.FAILED
    assert expected in _checks(node)["plausibility"].detail


@pytest.mark.django_db
def test_automatic_pool_admits_on_enrollment(anon_api, django_capture_on_commit_callbacks):
    pool = make_pool(admission_mode="automatic")
    token = make_token(pool)
    with django_capture_on_commit_callbacks(execute=True):
        response = enroll(anon_api, token)
    assert response.status_code == 201
    node = Node.objects.get(pk=response.json()["node_id"])
    assert node.lifecycle == Lifecycle.READY
    assert node.admission_attempt == 1


@pytest.mark.django_db
def test_valid_attestation_passes_and_a_forged_one_fails(anon_api, django_capture_on_commit_callbacks):
    signer = Signer()
    pool = make_pool(admission_mode="automatic", attestation_required=True, attestation_public_key=signer.public_pem)
    token = make_token(pool)
    good = signer.attest({"hostname": "h1.example.test", "pool": pool.name, "tpm": "ok"})
    forged = {**good, "signature": Signer().attest({"hostname": "h1.example.test"})["signature"]}
    replayed = signer.attest({"hostname": "someone-else"})
    with django_capture_on_commit_callbacks(execute=True):
        ok = enroll(anon_api, token, attestation=good).json()["node_id"]
        bad = enroll(anon_api, token, attestation=forged).json()["node_id"]
        other = enroll(anon_api, token, attestation=replayed).json()["node_id"]
        none = enroll(anon_api, token).json()["node_id"]
    assert Node.objects.get(pk=ok).lifecycle == Lifecycle.READY
    assert Node.objects.get(pk=ok).attestation_verified is True
    rejected = Node.objects.get(pk=bad)
    assert rejected.lifecycle == Lifecycle.REJECTED and rejected.attestation_verified is False
    assert "does not verify" in rejected.lifecycle_reason
    assert "someone-else" in Node.objects.get(pk=other).lifecycle_reason
    assert "requires attestation" in Node.objects.get(pk=none).lifecycle_reason


@pytest.mark.django_db
def test_garbage_attestation_encoding_fails_the_check(django_capture_on_commit_callbacks):
    signer = Signer()
    pool = make_pool(attestation_required=True, attestation_public_key=signer.public_pem)
    node = NodeFactory(pool=pool, attestation={"document": "%%%", "signature": "!!"})
    from fleet.services import node_admit

    with django_capture_on_commit_callbacks(execute=True):
        node_admit(node_id=node.pk, expected_version=1, actor=SYSTEM)
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.REJECTED
    assert "base64" in _checks(node)["attestation"].detail


@pytest.mark.django_db
def test_a_crash_midway_leaves_admitting_and_a_retry_finishes(monkeypatch):
    node = NodeFactory()
    from fleet.services import node_admit

    node_admit(node_id=node.pk, expected_version=1, actor=SYSTEM)  # on_commit not run: the task "was lost"
    node.refresh_from_db()

    def explode(node, pool):
        raise RuntimeError("worker died")

    monkeypatch.setattr(admission, "QUICK_CHECKS", [*admission.QUICK_CHECKS[:2], ("labels", explode)])
    with pytest.raises(RuntimeError):
        admission.run_admission(node_id=node.pk, attempt=node.admission_attempt, actor=SYSTEM)
    node.refresh_from_db()
    assert node.lifecycle == Lifecycle.ADMITTING
    statuses = {n: c.status for n, c in _checks(node).items()}
    assert statuses["agent_version"] == statuses["capabilities"] == CheckStatus.PASSED
    assert statuses["labels"] == CheckStatus.PENDING

    monkeypatch.undo()
    assert admission.run_admission(node_id=node.pk, attempt=node.admission_attempt, actor=SYSTEM) == "ready"
    assert NodeEvent.objects.filter(node=node, type=fleet_events.ADMISSION_CHECK).count() == len(
        admission.check_names(node.pool)
    )
    assert admission.run_admission(node_id=node.pk, attempt=node.admission_attempt, actor=SYSTEM) == "stale"


@pytest.mark.django_db
def test_a_stale_attempt_changes_nothing():
    node = NodeFactory()
    assert admission.run_admission(node_id=node.pk, attempt=1, actor=SYSTEM) == "stale"
    assert AdmissionCheck.objects.count() == 0


@pytest.fixture
def lost_tasks(monkeypatch):
    """Dispatched admission tasks go nowhere (the test runs admission itself; failsafe.publish sends them)."""
    from fleet import tasks

    monkeypatch.setattr(tasks.run_admission, "apply_async", lambda *args, **kwargs: None)


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_admission_runs_at_once_decide_once(lost_tasks):
    from fleet.services import node_admit

    node = NodeFactory()
    node_admit(node_id=node.pk, expected_version=1, actor=SYSTEM)
    attempt = Node.objects.get().admission_attempt
    outcome = race(lambda index: admission.run_admission(node_id=node.pk, attempt=attempt, actor=SYSTEM), 4)
    assert not outcome.errors, outcome.errors
    results = outcome.results
    assert Node.objects.get().lifecycle == Lifecycle.READY
    assert results.count("ready") == 1, results
    assert NodeEvent.objects.filter(node=node, type=fleet_events.LIFECYCLE, to_state="ready").count() == 1
    assert NodeEvent.objects.filter(node=node, type=fleet_events.ADMISSION_CHECK).count() == len(
        admission.check_names(node.pool)
    )
    assert NodeResource.objects.filter(node=node).count() == 3


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_operators_admitting_the_same_version_one_wins(lost_tasks):
    from fleet.services import node_admit
    from nodepool.api.problems import PreconditionFailed

    node = NodeFactory(pool=make_pool(kind=PoolKind.STANDARD))

    def act(index):
        try:
            node_admit(node_id=node.pk, expected_version=1, actor=Actor.system("op"))
            return "ok"
        except PreconditionFailed:
            return "412"

    outcome = race(act, 5)
    assert not outcome.errors, outcome.errors
    outcomes = outcome.results
    assert sorted(outcomes) == ["412"] * 4 + ["ok"]
    assert Node.objects.get().admission_attempt == 1


@pytest.mark.django_db
def test_admission_events_name_the_celery_task_as_actor(operator_api, django_capture_on_commit_callbacks):
    node = NodeFactory()
    with django_capture_on_commit_callbacks(execute=True):
        _admit(operator_api, node)
    final = NodeEvent.objects.get(node=node, type=fleet_events.LIFECYCLE, to_state="ready")
    assert (final.actor_type, final.actor_name) == ("system", "fleet.run_admission")
    assert final.request_id  # the Celery task id


@pytest.mark.django_db
def test_admit_with_a_malformed_body_changes_nothing(operator_api):
    node = NodeFactory()
    url = f"/api/v1/nodes/{node.pk}/admit"
    response = operator_api.post(url, "{oops", content_type="application/json", HTTP_IF_MATCH='"1"')
    assert response.status_code == 400 and response.json()["code"] == "malformed_body"
    response = operator_api.post(url, "reason", content_type="text/plain", HTTP_IF_MATCH='"1"')
    assert response.status_code == 415
    response = operator_api.post(url, {"reason": "x" * 2000}, format="json", HTTP_IF_MATCH='"1"')
    assert response.status_code == 400
    assert Node.objects.get().lifecycle == Lifecycle.PENDING
