"""Hashed, expiring user API tokens (issue 11, item 6) and login lockout (item 2)."""

from __future__ import annotations

import hashlib
import importlib
import io

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.utils import timezone
from knox.models import AuthToken
from rest_framework.test import APIClient

from nodepool.api.permissions import OPERATORS
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db


def _token_api(key):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return api


def _operator(name="ops"):
    user = User.objects.create_user(name, password="correct horse battery staple", is_staff=True)
    user.groups.add(Group.objects.get_or_create(name=OPERATORS)[0])
    return user


def test_the_creation_command_prints_a_key_that_is_stored_only_as_a_hash():
    _operator()
    out = io.StringIO()

    call_command("create_api_token", "ops", stdout=out)

    key = out.getvalue().split()[2]
    stored = AuthToken.objects.get(user__username="ops")
    assert stored.digest == hashlib.sha512(key.encode()).hexdigest()
    assert key not in stored.digest and key != stored.token_key
    assert _token_api(key).get("/api/v1/nodes").status_code == 200
    assert "Expires:" in out.getvalue()


def test_a_user_token_expires(time_machine):
    time_machine.move_to(timezone.now(), tick=False)
    _operator()
    out = io.StringIO()
    call_command("create_api_token", "ops", "--ttl-days", "1", stdout=out)
    key = out.getvalue().split()[2]
    assert _token_api(key).get("/api/v1/nodes").status_code == 200

    time_machine.shift(24 * 3600 + 1)

    assert_problem(_token_api(key).get("/api/v1/nodes"), 401, "authentication_failed")


def test_authentication_reads_only_the_presented_token_and_expired_ones_are_pruned_hourly(time_machine):
    """knox scanned (and deleted) the user's other expired tokens on every request: one more query
    on the hot path. nodepool checks the presented token only; the beat task prunes the rest."""
    from datetime import timedelta

    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from nodepool.celery import prune_expired_tokens
    from nodepool.schedule import BEAT_SCHEDULE
    from nodepool.tokens import create_user_token

    time_machine.move_to(timezone.now(), tick=False)
    user = _operator()
    create_user_token(user, ttl=timedelta(hours=1))  # will expire, unused
    _, key = create_user_token(user, ttl=timedelta(days=1))
    time_machine.shift(2 * 3600)

    with CaptureQueriesContext(connection) as queries:
        assert _token_api(key).get("/api/v1/pools").status_code == 200
    assert sum("knox_authtoken" in q["sql"] for q in queries.captured_queries) == 1
    assert AuthToken.objects.filter(user=user).count() == 2  # the expired one waits for the task

    assert prune_expired_tokens() == 0  # expired tokens' digests are kept a while (token_expired)
    from nodepool import tokens

    assert tokens.prune_expired_tokens(now=timezone.now() + timedelta(days=30, hours=12)) == 1
    assert AuthToken.objects.filter(user=user).count() == 1
    assert BEAT_SCHEDULE["nodepool.prune_expired_tokens"]["task"] == "nodepool.prune_expired_tokens"
    time_machine.shift(24 * 3600)
    body = assert_problem(_token_api(key).get("/api/v1/pools"), 401, "authentication_failed")
    assert body["reason"] == "token_expired"
    assert AuthToken.objects.filter(user=user).exists()  # kept, so that it keeps saying so


def test_a_token_is_expired_at_the_instant_of_its_expiry_and_says_token_expired(time_machine):
    """Issue 30, item 6: expiry is inclusive; an expired token gets a stable reason, not the
    generic "Invalid token." a made-up one gets."""
    from datetime import timedelta

    from nodepool.tokens import create_user_token

    time_machine.move_to(timezone.now(), tick=False)
    stored, key = create_user_token(_operator(), ttl=timedelta(hours=1))
    time_machine.move_to(stored.expiry - timedelta(microseconds=1), tick=False)
    assert _token_api(key).get("/api/v1/pools").status_code == 200
    time_machine.move_to(stored.expiry, tick=False)
    body = assert_problem(_token_api(key).get("/api/v1/pools"), 401, "authentication_failed")
    assert body["reason"] == "token_expired"
    made_up = assert_problem(_token_api(key[:-4] + "0000").get("/api/v1/pools"), 401, "authentication_failed")
    assert "reason" not in made_up


def test_an_unknown_user_is_a_command_error():
    from django.core.management import CommandError

    with pytest.raises(CommandError):
        call_command("create_api_token", "nobody", stdout=io.StringIO())


@pytest.mark.django_db(transaction=True)
def test_existing_drf_tokens_move_to_hashes_and_keep_working():
    user = _operator()
    legacy = "0123456789abcdef0123456789abcdef01234567"  # a DRF key: 40 hex characters
    with connection.cursor() as cursor:
        cursor.execute(
            'CREATE TABLE authtoken_token ("key" varchar(40) PRIMARY KEY, created timestamp, user_id integer)'
        )
        cursor.execute("INSERT INTO authtoken_token VALUES (%s, %s, %s)", [legacy, timezone.now(), user.pk])
    try:
        migration = importlib.import_module("nodepool.migrations.0001_user_tokens_from_drf")
        from django.apps import apps
        from django.db.backends.base.schema import BaseDatabaseSchemaEditor

        migration.forwards(apps, BaseDatabaseSchemaEditor(connection))

        with connection.cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM authtoken_token")
            assert cursor.fetchone()[0] == 0  # no plaintext left
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE authtoken_token")
    stored = AuthToken.objects.get(user=user)
    assert stored.expiry is not None and legacy not in stored.digest
    assert _token_api(legacy).get("/api/v1/nodes").status_code == 200


# --- login lockout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("login_url", ["/admin/login/", "/api-auth/login/"])
def test_thirty_wrong_passwords_lock_the_login_even_for_the_right_one(client, login_url):
    _operator()
    for _ in range(30):
        client.post(login_url, {"username": "ops", "password": "wrong"})

    response = client.post(login_url, {"username": "ops", "password": "correct horse battery staple"})

    assert response.status_code == 429
    assert b"Login locked" in response.content and b"unlock_login" in response.content
    assert "_auth_user_id" not in client.session


def test_the_lockout_is_per_user_and_address(client, settings):
    _operator()
    for _ in range(settings.AXES_FAILURE_LIMIT):
        client.post("/admin/login/", {"username": "ops", "password": "wrong"})

    elsewhere = client.post(
        "/admin/login/", {"username": "ops", "password": "correct horse battery staple"}, REMOTE_ADDR="10.9.9.9"
    )

    assert elsewhere.status_code == 302  # logged in from another address


def behind_proxy(settings):
    """The compose shape: one proxy (deploy/nginx) appending the address it saw to X-Forwarded-For."""
    settings.NODEPOOL_TRUSTED_PROXIES = ["172.18.0.0/16"]
    proxy = {"REMOTE_ADDR": "172.18.0.5"}

    def via(client_address: str, forged: str | None = None) -> dict:
        chain = f"{forged}, {client_address}" if forged else client_address
        return {**proxy, "HTTP_X_FORWARDED_FOR": chain}

    return via


def test_behind_the_proxy_a_guesser_locks_only_its_own_address_not_the_real_operator(client, settings):
    via = behind_proxy(settings)
    _operator()
    for _ in range(settings.AXES_FAILURE_LIMIT):
        client.post("/admin/login/", {"username": "ops", "password": "wrong"}, **via("198.51.100.66"))

    real = client.post("/admin/login/", {"username": "ops", "password": "correct horse battery staple"},
                       **via("203.0.113.10"))  # fmt: skip
    guesser = Client().post("/admin/login/", {"username": "ops", "password": "correct horse battery staple"},
                            **via("198.51.100.66"))  # fmt: skip

    assert real.status_code == 302  # every client behind the proxy used to share one (absent) address
    assert guesser.status_code == 429


def test_behind_the_proxy_a_forged_x_forwarded_for_does_not_reset_the_count(client, settings):
    via = behind_proxy(settings)
    _operator()
    for n in range(settings.AXES_FAILURE_LIMIT):
        client.post("/admin/login/", {"username": "ops", "password": "wrong"}, **via("198.51.100.66", f"10.0.0.{n}"))

    response = client.post("/admin/login/", {"username": "ops", "password": "correct horse battery staple"},
                           **via("198.51.100.66", "10.0.0.99"))  # fmt: skip

    assert response.status_code == 429


def test_a_client_reaching_gunicorn_directly_cannot_pick_its_address_to_dodge_the_lockout(client, settings):
    """The hop count believed any peer's X-Forwarded-For; trusted proxies are chosen by address."""
    settings.NODEPOOL_TRUSTED_PROXIES = ["172.18.0.0/16"]
    _operator()
    direct = {"REMOTE_ADDR": "198.51.100.66"}
    for n in range(settings.AXES_FAILURE_LIMIT):
        client.post("/admin/login/", {"username": "ops", "password": "wrong"},
                    HTTP_X_FORWARDED_FOR=f"10.0.0.{n}", **direct)  # fmt: skip

    response = client.post("/admin/login/", {"username": "ops", "password": "correct horse battery staple"},
                           HTTP_X_FORWARDED_FOR="10.0.0.99", **direct)  # fmt: skip

    assert response.status_code == 429


def test_a_few_wrong_passwords_then_the_right_one_log_in_and_reset_the_count(client, settings):
    _operator()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        client.post("/admin/login/", {"username": "ops", "password": "wrong"})

    response = client.post("/admin/login/", {"username": "ops", "password": "correct horse battery staple"})

    assert response.status_code == 302 and client.session["_auth_user_id"]


def test_an_operator_unlocks_a_locked_login_with_a_command(client, settings):
    _operator()
    for _ in range(settings.AXES_FAILURE_LIMIT):
        client.post("/admin/login/", {"username": "ops", "password": "wrong"})
    assert (
        client.post("/admin/login/", {"username": "ops", "password": "correct horse battery staple"}).status_code == 429
    )
    out = io.StringIO()

    call_command("unlock_login", "ops", stdout=out)

    assert "Unlocked ops" in out.getvalue()
    response = client.post("/admin/login/", {"username": "ops", "password": "correct horse battery staple"})
    assert response.status_code == 302
