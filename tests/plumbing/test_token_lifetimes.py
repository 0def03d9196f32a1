"""User token lifetimes (issue 30, item 6): optional sliding refresh up to a maximum lifetime, log out
everywhere (the user's own endpoint, the operator's endpoint and admin action), ``token_expired``
and inclusive expiry under sliding refresh."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client
from django.utils import timezone
from knox.models import AuthToken
from rest_framework.test import APIClient

from nodepool.api.permissions import CLIENTS, OPERATORS
from nodepool.tokens import create_user_token
from tests.factories import PoolFactory, make_schedulable_node
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery staple"


def _user(name: str, role: str = OPERATORS) -> User:
    user = User.objects.create_user(name, password=PASSWORD, is_staff=True)
    user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


def _api(key: str) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return api


@pytest.fixture
def sliding(settings):
    """Sliding refresh on: idle lifetime 1 day, maximum 3 days from creation."""
    settings.NODEPOOL_USER_TOKEN_SLIDING = True
    settings.NODEPOOL_USER_TOKEN_TTL_DAYS = 1
    settings.NODEPOOL_USER_TOKEN_MAX_LIFETIME_DAYS = 3
    settings.REST_KNOX = {
        **settings.REST_KNOX,
        "TOKEN_TTL": timedelta(days=1),
        "AUTO_REFRESH": True,
        "AUTO_REFRESH_MAX_TTL": timedelta(days=3),
    }


# --- sliding refresh ----------------------------------------------------------------------------------


def test_each_use_slides_the_expiry_up_to_the_maximum_lifetime_then_token_expired(sliding, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    created = timezone.now()
    _, key = create_user_token(_user("ops"))
    api = _api(key)

    for hours in (20, 40):  # used every 20 h: each use gives it another day from then
        time_machine.move_to(created + timedelta(hours=hours), tick=False)
        assert api.get("/api/v1/nodes").status_code == 200
        assert AuthToken.objects.get().expiry == created + timedelta(hours=hours + 24)
    time_machine.move_to(created + timedelta(hours=60), tick=False)
    assert api.get("/api/v1/nodes").status_code == 200  # 60 h + a day would pass the maximum (72 h)
    assert AuthToken.objects.get().expiry == created + timedelta(days=3)
    time_machine.move_to(created + timedelta(hours=71), tick=False)
    assert api.get("/api/v1/nodes").status_code == 200
    assert AuthToken.objects.get().expiry == created + timedelta(days=3)  # never past the maximum

    time_machine.move_to(created + timedelta(days=3), tick=False)  # the instant of expiry: expired
    body = assert_problem(api.get("/api/v1/nodes"), 401, "authentication_failed")
    assert body["reason"] == "token_expired"


def test_an_idle_sliding_token_expires_after_its_idle_lifetime(sliding, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    _, key = create_user_token(_user("ops"))
    assert _api(key).get("/api/v1/nodes").status_code == 200

    time_machine.shift(timedelta(days=1))

    assert assert_problem(_api(key).get("/api/v1/nodes"), 401, "authentication_failed")["reason"] == "token_expired"


def test_a_sliding_token_is_written_at_most_once_a_minute(sliding, time_machine):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    time_machine.move_to(timezone.now(), tick=False)
    _, key = create_user_token(_user("ops"))
    api = _api(key)
    api.get("/api/v1/nodes")
    time_machine.shift(30)
    with CaptureQueriesContext(connection) as queries:
        assert api.get("/api/v1/nodes").status_code == 200
    assert not [q for q in queries if q["sql"].startswith("UPDATE") and "knox_authtoken" in q["sql"]]


def test_with_sliding_a_new_tokens_lifetime_is_capped_at_the_maximum(sliding, time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    stored, _ = create_user_token(_user("ops"), ttl=timedelta(days=30))
    assert stored.expiry == timezone.now() + timedelta(days=3)


def test_without_sliding_use_does_not_move_the_expiry(time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    stored, key = create_user_token(_user("ops"), ttl=timedelta(days=1))
    time_machine.shift(timedelta(hours=20))
    assert _api(key).get("/api/v1/nodes").status_code == 200
    assert AuthToken.objects.get().expiry == stored.expiry


def test_sliding_needs_an_idle_lifetime(monkeypatch):
    """Settings refuse to start with sliding refresh on and tokens that never expire."""
    import importlib

    from django.core.exceptions import ImproperlyConfigured

    import nodepool.settings as module

    monkeypatch.setenv("NODEPOOL_USER_TOKEN_SLIDING", "true")
    monkeypatch.setenv("NODEPOOL_USER_TOKEN_TTL_DAYS", "0")
    try:
        with pytest.raises(ImproperlyConfigured, match="NODEPOOL_USER_TOKEN_SLIDING"):
            importlib.reload(module)
    finally:
        monkeypatch.undo()
        importlib.reload(module)


# --- log out everywhere ------------------------------------------------------------------------------


def _signed_in_session(user: User) -> Client:
    browser = Client()
    assert browser.post("/admin/login/", {"username": user.username, "password": PASSWORD}).status_code == 302
    return browser


def test_a_user_logs_out_everywhere_revoking_every_token_and_session(client):
    me, other = _user("alice", CLIENTS), _user("bob", CLIENTS)
    _, first = create_user_token(me)
    _, second = create_user_token(me)
    _, others = create_user_token(other)
    browser = _signed_in_session(me)

    response = _api(first).post("/api/v1/auth/logout-everywhere")

    assert response.status_code == 200, response.content
    assert response.json() == {"username": "alice", "tokens_revoked": 2, "sessions_ended": 1}
    for key in (first, second):
        body = assert_problem(_api(key).get("/api/v1/pools"), 401, "authentication_failed")
        assert body.get("reason") != "token_expired"  # revoked, not expired
    assert browser.get("/admin/").status_code == 302  # back to the login page
    assert _api(others).get("/api/v1/pools").status_code == 200  # another user's token still works


def test_an_operator_logs_any_user_out_everywhere():
    _user("ops")
    victim = _user("carol", CLIENTS)
    _, ops_key = create_user_token(User.objects.get(username="ops"))
    _, key = create_user_token(victim)

    response = _api(ops_key).post("/api/v1/users/carol/logout-everywhere")

    assert response.status_code == 200, response.content
    assert response.json()["tokens_revoked"] == 1
    assert_problem(_api(key).get("/api/v1/pools"), 401, "authentication_failed")
    assert _api(ops_key).get("/api/v1/nodes").status_code == 200


def test_the_admin_logs_selected_users_out_everywhere(admin_client):
    victim = _user("dave", CLIENTS)
    create_user_token(victim)
    create_user_token(victim)

    response = admin_client.post(
        "/admin/auth/user/", {"action": "log_out_everywhere_action", "_selected_action": [victim.pk]}, follow=True
    )

    assert response.status_code == 200
    assert b"2 API token(s) revoked" in response.content
    assert not AuthToken.objects.filter(user=victim).exists()


@pytest.mark.parametrize(
    ("who", "path", "body", "status", "code"),
    [
        ("client", "/api/v1/users/ops/logout-everywhere", None, 403, "forbidden"),  # not an operator
        ("operator", "/api/v1/users/nobody/logout-everywhere", None, 404, "user_not_found"),
        ("operator", "/api/v1/users/ops/logout-everywhere", {"everywhere": True}, 400, "unknown_field"),
        ("operator", "/api/v1/auth/logout-everywhere", {"all": 1}, 400, "unknown_field"),
        ("operator", "/api/v1/auth/logout-everywhere", [1], 400, "malformed_body"),
        ("nobody", "/api/v1/auth/logout-everywhere", None, 401, "not_authenticated"),
        ("node", "/api/v1/auth/logout-everywhere", None, 403, "forbidden"),
        ("node", "/api/v1/users/ops/logout-everywhere", None, 403, "forbidden"),
    ],
)
def test_bad_requests_are_refused_and_revoke_nothing(who, path, body, status, code):
    _user("ops")
    _user("cli", CLIENTS)
    _, ops_key = create_user_token(User.objects.get(username="ops"))
    _, cli_key = create_user_token(User.objects.get(username="cli"))
    api = APIClient()
    if who == "operator":
        api.credentials(HTTP_AUTHORIZATION=f"Token {ops_key}")
    elif who == "client":
        api.credentials(HTTP_AUTHORIZATION=f"Token {cli_key}")
    elif who == "node":
        _, secret = make_schedulable_node(PoolFactory())
        api.credentials(HTTP_AUTHORIZATION=f"Node {secret}")

    response = api.post(path, body, format="json") if body is not None else api.post(path)

    assert_problem(response, status, code)
    assert AuthToken.objects.count() == 2
