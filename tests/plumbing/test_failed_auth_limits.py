"""Failed authentication is limited (issue 30, item 4): refused user tokens and node credentials
per client address, with the counter in the database (it holds while Redis is down), and a
per-account ceiling on failed logins across addresses that does not lock the real operator out."""

from __future__ import annotations

import io
import json
import threading
import uuid
from urllib.parse import urlsplit

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import connection
from django.test import Client

from nodepool import auth_failures, failsafe
from nodepool.api.permissions import OPERATORS
from nodepool.models import AuthFailureCount
from tests.factories import PoolFactory, make_schedulable_node
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery staple"


@pytest.fixture
def limit(settings):
    settings.NODEPOOL = {
        **settings.NODEPOOL,
        "MIN_SPACING_FRACTION": 0,
        "AUTH_FAILURE_LIMIT": 5,
        "AUTH_FAILURE_WINDOW_SECONDS": 600,
    }
    return 5


def _nodes(address: str, authorization: str):
    return Client().get("/api/v1/nodes", HTTP_AUTHORIZATION=authorization, REMOTE_ADDR=address)


def _renew(node_id, authorization: str, address: str, sequence: int = 1):
    return Client().post(
        f"/api/v1/nodes/{node_id}/renewals",
        json.dumps({"incarnation": 1, "sequence": sequence}),
        content_type="application/json",
        HTTP_AUTHORIZATION=authorization,
        REMOTE_ADDR=address,
    )


def _assert_throttled(response):
    body = assert_problem(response, 429, "auth_failures_throttled")
    assert 1 <= int(response["Retry-After"]) <= 600
    assert body["retry_after"] == int(response["Retry-After"])


def test_made_up_user_tokens_from_one_address_get_429_with_retry_after_after_the_limit(limit):
    for n in range(limit):
        assert_problem(_nodes("198.51.100.7", f"Token npu_{n:064x}"), 401, "authentication_failed")

    _assert_throttled(_nodes("198.51.100.7", "Token npu_" + "f" * 64))
    _assert_throttled(_nodes("198.51.100.7", "Bearer npu_" + "e" * 64))
    # Another address is not affected; the counter is one database row per address and window.
    assert_problem(_nodes("198.51.100.8", "Token npu_" + "f" * 64), 401, "authentication_failed")
    assert AuthFailureCount.objects.get(scope="address", key="198.51.100.7").count == limit


def test_made_up_node_credentials_on_renewals_and_the_api_count_together(limit):
    node_id = uuid.uuid4()
    for n in range(limit - 1):
        assert_problem(_renew(node_id, f"Node npn_{n:08x}.{'a' * 40}", "198.51.100.9"), 401, "authentication_failed")
    assert_problem(_nodes("198.51.100.9", "Node npn_ffffffff." + "b" * 40), 401, "authentication_failed")

    _assert_throttled(_renew(node_id, "Node npn_eeeeeeee." + "c" * 40, "198.51.100.9"))


def test_a_node_this_process_accepted_keeps_renewing_from_a_blocked_address(limit):
    """Healthy nodes behind the same NAT as a guesser are not cut off."""
    node, secret = make_schedulable_node(PoolFactory(name="general"))
    assert _renew(node.pk, f"Node {secret}", "192.0.2.50", sequence=1).status_code == 200
    for n in range(limit):
        _renew(node.pk, f"Node npn_{n:08x}.{'d' * 40}", "192.0.2.50")
    _assert_throttled(_renew(node.pk, "Node npn_00000000." + "e" * 40, "192.0.2.50"))

    response = _renew(node.pk, f"Node {secret}", "192.0.2.50", sequence=2)

    assert response.status_code == 200, response.content


def test_another_process_learns_the_block_from_the_database_with_one_more_failure(limit):
    for n in range(limit):
        _nodes("198.51.100.10", f"Token npu_{n:064x}")
    auth_failures.reset_process_state()  # a fresh process: nothing blocked in memory

    assert_problem(_nodes("198.51.100.10", "Token npu_" + "1" * 64), 401, "authentication_failed")
    _assert_throttled(_nodes("198.51.100.10", "Token npu_" + "2" * 64))


def test_ipv6_clients_are_counted_per_64(limit):
    for n in range(limit):
        _nodes(f"2001:db8:1:2::{n + 1:x}", f"Token npu_{n:064x}")

    _assert_throttled(_nodes("2001:db8:1:2:ffff::1", "Token npu_" + "3" * 64))
    assert_problem(_nodes("2001:db8:1:3::1", "Token npu_" + "3" * 64), 401, "authentication_failed")


def test_requests_without_credentials_and_valid_tokens_do_not_count(limit, admin_user):
    from nodepool.tokens import create_user_token

    admin_user.groups.add(Group.objects.get_or_create(name=OPERATORS)[0])
    _, key = create_user_token(admin_user)
    for _ in range(limit + 2):
        assert _nodes("198.51.100.11", f"Token {key}").status_code == 200
        assert Client().get("/api/v1/nodes", REMOTE_ADDR="198.51.100.11").status_code == 401
    assert not AuthFailureCount.objects.exists()


@pytest.mark.slow
def test_the_limit_holds_while_redis_is_unreachable(limit, settings):
    """The cache on a real Redis behind a proxy that is stopped: the counter is in the database."""
    from tests.celery_support import REDIS_URL, redis_answers
    from tests.tcp_proxy_support import TcpProxy

    if not redis_answers():
        pytest.skip(f"Redis does not answer at {REDIS_URL}")
    target = urlsplit(REDIS_URL)
    proxy = TcpProxy(target.port or 6379, target.hostname or "127.0.0.1")
    settings.CACHES = {
        "default": {
            "BACKEND": "nodepool.failsafe.FailOpenRedisCache",
            "LOCATION": f"redis://127.0.0.1:{proxy.port}/{(target.path or '/0').lstrip('/') or '0'}",
            "KEY_PREFIX": f"np-authfail-{proxy.port}",
            "OPTIONS": {"socket_timeout": 0.25, "socket_connect_timeout": 0.25},
        }
    }
    failsafe.CACHE_CIRCUIT.reset()
    try:
        proxy.stop()
        for n in range(limit):
            assert_problem(_nodes("198.51.100.12", f"Token npu_{n:064x}"), 401, "authentication_failed")
        _assert_throttled(_nodes("198.51.100.12", "Token npu_" + "4" * 64))
        auth_failures.reset_process_state()  # and another process still reads it from the database
        _nodes("198.51.100.12", "Token npu_" + "5" * 64)
        _assert_throttled(_nodes("198.51.100.12", "Token npu_" + "6" * 64))
    finally:
        proxy.close()
        failsafe.CACHE_CIRCUIT.reset()


@pytest.mark.django_db(transaction=True)
def test_racing_failures_each_get_a_distinct_count():
    """Concurrent upserts on one row: no lost update, no duplicate row (PostgreSQL and SQLite)."""
    threads, counts, errors = 8, [], []
    barrier = threading.Barrier(threads)

    def fail():
        try:
            barrier.wait()
            for _ in range(5):
                counts.append(auth_failures.count_failure("address", "203.0.113.99", 600)[0])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    workers = [threading.Thread(target=fail) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    assert not errors
    assert sorted(counts) == list(range(1, threads * 5 + 1))
    assert AuthFailureCount.objects.get(key="203.0.113.99").count == threads * 5


def test_old_windows_are_pruned_hourly():
    import time

    from nodepool.celery import prune_expired_tokens

    auth_failures.count_failure("address", "198.51.100.13", 60, now=time.time() - 2 * 86400)
    auth_failures.count_failure("address", "198.51.100.14", 60)

    assert prune_expired_tokens() == 1
    assert list(AuthFailureCount.objects.values_list("key", flat=True)) == ["198.51.100.14"]


# --- per-account ceiling across addresses -----------------------------------------------------------


@pytest.fixture
def ceiling(settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "LOGIN_ACCOUNT_FAILURE_LIMIT": 3}
    settings.AXES_FAILURE_LIMIT = 5
    user = User.objects.create_user("ops", password=PASSWORD, is_staff=True)
    user.groups.add(Group.objects.get_or_create(name=OPERATORS)[0])
    return 3


def _login(address: str, password: str):
    return Client().post("/admin/login/", {"username": "ops", "password": password}, REMOTE_ADDR=address)


def test_guesses_spread_over_addresses_close_the_account_to_unfamiliar_addresses_not_to_the_operator(ceiling):
    assert _login("203.0.113.10", PASSWORD).status_code == 302  # the operator's usual address
    for n in range(ceiling):  # one guess each from many addresses: axes' per-address lockout never trips
        assert _login(f"198.51.100.{n + 20}", "wrong").status_code == 200

    guesser = _login("198.51.100.99", PASSWORD)  # even the right password, from a new address
    operator = _login("203.0.113.10", PASSWORD)

    assert guesser.status_code == 429
    assert b"from many addresses" in guesser.content and 1 <= int(guesser["Retry-After"]) <= 15 * 60
    assert operator.status_code == 302  # a familiar address is never refused by the ceiling


def test_an_operator_command_lifts_the_ceiling(ceiling):
    for n in range(ceiling):
        _login(f"198.51.100.{n + 20}", "wrong")
    assert _login("198.51.100.99", PASSWORD).status_code == 429
    out = io.StringIO()

    call_command("unlock_login", "ops", stdout=out)

    assert "1 account window(s) cleared" in out.getvalue()
    assert _login("198.51.100.99", PASSWORD).status_code == 302


def test_refused_attempts_do_not_prolong_the_ceiling_and_it_ends_with_its_window(ceiling, time_machine):
    from django.utils import timezone

    time_machine.move_to(timezone.now(), tick=False)
    for n in range(ceiling):
        _login(f"198.51.100.{n + 20}", "wrong")
    for _ in range(5):
        assert _login("198.51.100.99", "wrong").status_code == 429
    assert AuthFailureCount.objects.get(scope="login", key="ops").count == ceiling

    time_machine.shift(15 * 60 + 1)

    assert _login("198.51.100.99", PASSWORD).status_code == 302
