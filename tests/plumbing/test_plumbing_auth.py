"""Users, roles and tokens: the three role groups, DRF tokens and sessions on the API."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from knox.models import AuthToken
from rest_framework.test import APIClient

from nodepool.api.permissions import CLIENTS, OPERATORS, OWNERS
from nodepool.roles import ensure_roles
from nodepool.tokens import create_user_token
from tests.problems import assert_problem

pytestmark = [pytest.mark.urls("tests.plumbing_urls"), pytest.mark.django_db]


def test_the_three_role_groups_exist_after_migrate():
    assert set(Group.objects.filter(name__in=[OPERATORS, OWNERS, CLIENTS]).values_list("name", flat=True)) == {
        OPERATORS,
        OWNERS,
        CLIENTS,
    }


def perms(group: str) -> set[str]:
    return {
        f"{app}.{codename}"
        for app, codename in Group.objects.get(name=group).permissions.values_list(
            "content_type__app_label", "codename"
        )
    }


def test_operators_may_change_the_fleet_and_the_beat_schedule():
    granted = perms(OPERATORS)
    assert {"fleet.change_node", "fleet.add_pool", "leases.change_lease", "django_celery_beat.change_periodictask"} <= (
        granted
    )


def test_owners_may_only_view_nodes_and_file_appeals():
    granted = perms(OWNERS)
    assert "fleet.view_node" in granted
    writes = {p for p in granted if p.split(".")[1].startswith(("add_", "change_", "delete_"))}
    assert writes == {"marketplace.add_appeal"}, "an owner may contest a quarantine, and change nothing else"


def test_clients_may_ask_for_leases_but_not_touch_nodes():
    granted = perms(CLIENTS)
    assert {"leases.add_lease", "leases.view_lease"} <= granted
    assert "fleet.change_node" not in granted


def test_ensure_roles_is_idempotent():
    before = {g: perms(g) for g in (OPERATORS, OWNERS, CLIENTS)}
    ensure_roles()
    ensure_roles()
    assert {g: perms(g) for g in (OPERATORS, OWNERS, CLIENTS)} == before
    assert Group.objects.filter(name=OPERATORS).count() == 1


def test_drf_create_token_makes_a_token_that_authenticates():
    User.objects.create_user("sched-1")
    out = io.StringIO()

    call_command("drf_create_token", "sched-1", stdout=out)

    key = out.getvalue().split()[2]
    assert key.startswith("npu_") and AuthToken.objects.filter(user__username="sched-1").count() == 1
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    response = api.get("/plumbing/whoami")
    assert response.status_code == 200
    assert response.json() == {"username": "sched-1", "auth": "UserTokenAuthentication"}


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "Token"])
def test_a_user_token_is_accepted_under_bearer_as_under_token(scheme):
    User.objects.create_user("sched-3")
    out = io.StringIO()
    call_command("create_api_token", "sched-3", stdout=out)
    key = out.getvalue().split()[2]
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"{scheme} {key}")
    response = api.get("/plumbing/whoami")
    assert response.status_code == 200
    assert response.json()["username"] == "sched-3"
    api.credentials(HTTP_AUTHORIZATION="Bearer not-a-real-token")
    assert_problem(api.get("/plumbing/whoami"), 401, "authentication_failed")


def test_drf_create_token_reset_revokes_the_old_token():
    User.objects.create_user("sched-2")
    out = io.StringIO()
    call_command("drf_create_token", "sched-2", stdout=out)
    old = out.getvalue().split()[2]

    call_command("drf_create_token", "sched-2", "-r", stdout=io.StringIO())

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {old}")
    assert_problem(api.get("/plumbing/whoami"), 401, "authentication_failed")


def test_no_credentials_is_401_with_a_challenge(anon_api):
    response = anon_api.get("/plumbing/whoami")
    assert_problem(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"]


def test_a_wrong_token_is_401(anon_api):
    anon_api.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert_problem(anon_api.get("/plumbing/whoami"), 401, "authentication_failed")


def test_a_malformed_node_credential_is_401(anon_api):
    anon_api.credentials(HTTP_AUTHORIZATION="Node garbage")
    assert_problem(anon_api.get("/plumbing/whoami"), 401, "authentication_failed")


def test_anonymous_on_an_operator_endpoint_is_401_but_an_owner_is_403(anon_api, owner_api, operator_api):
    assert_problem(anon_api.get("/plumbing/operators-only"), 401, "not_authenticated")
    assert_problem(owner_api.get("/plumbing/operators-only"), 403, "forbidden")
    assert operator_api.get("/plumbing/operators-only").status_code == 200


def test_a_superuser_counts_as_an_operator():
    admin = User.objects.create_superuser("root", password="pw-root-123")
    api = APIClient()
    api.force_authenticate(admin)
    assert api.get("/plumbing/operators-only").status_code == 200


def test_session_authentication_works_on_the_api_and_needs_csrf_for_writes(operator):
    api = APIClient(enforce_csrf_checks=True)
    assert api.login(username=operator.username, password="pw-" + operator.username)

    response = api.get("/plumbing/whoami")
    assert response.json() == {"username": operator.username, "auth": "SessionAuthentication"}

    # A session write without the CSRF token is refused (403), with one it passes.
    assert_problem(api.post("/plumbing/whoami", {"a": 1}, format="json"), 403, "forbidden")
    api.get("/admin/login/")
    csrf = api.cookies["csrftoken"].value
    response = api.post("/plumbing/whoami", {"a": 1}, format="json", HTTP_X_CSRFTOKEN=csrf)
    assert response.status_code == 200
    assert response.json()["received"] == {"a": 1}


def test_the_api_root_lists_the_schema_and_docs(operator_api):
    response = operator_api.get("/api/v1/")
    assert response.status_code == 200
    links = response.json()["links"]
    assert links["schema"].endswith("/api/schema/")
    assert links["docs"].endswith("/api/docs/")


def test_token_and_session_both_reach_the_real_api_root(operator):
    token_api = APIClient()
    token_api.credentials(HTTP_AUTHORIZATION=f"Token {create_user_token(operator)[1]}")
    session_api = APIClient()
    session_api.force_login(operator)
    for api in (token_api, session_api):
        response = api.get("/api/v1/")
        assert response.status_code == 200
        assert response.wsgi_request.user == operator


def test_schema_and_docs_are_served(operator_api):
    schema = operator_api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert schema.status_code == 200
    assert operator_api.get("/api/docs/").status_code == 200
