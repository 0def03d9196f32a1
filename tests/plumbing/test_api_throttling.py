"""nodepool.api.throttling.UserRateThrottle: DRF's per-user rate (scope ``user``) counted in two
cache counters, whatever the rate, with a ``Retry-After`` after which the client is let through."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from django.contrib.auth import get_user_model
from django.core.cache import cache
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory, force_authenticate
from rest_framework.views import APIView

from nodepool.api.throttling import UserRateThrottle, client_address
from tests.fleet_support import fresh_throttles  # noqa: F401

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fresh_throttles")]
T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)  # a window boundary (minutes since the epoch)


class FivePerMinute(UserRateThrottle):
    rate = "5/min"


class Limited(APIView):
    permission_classes: list = []
    throttle_classes = [FivePerMinute]

    def get(self, request):
        return Response({"ok": True})


@pytest.fixture
def call():
    users = {name: get_user_model().objects.create(username=name) for name in ("ada", "bob")}
    factory = APIRequestFactory()

    def call(name="ada"):
        request = factory.get("/limited")
        force_authenticate(request, user=users[name])
        return Limited.as_view()(request)

    return call


def test_the_rate_holds_per_user_and_retry_after_lets_the_client_through(call):
    with time_machine.travel(T0, tick=False) as clock:
        assert [call().status_code for _ in range(6)] == [200] * 5 + [429]
        assert call("bob").status_code == 200  # another user's budget
        refused = call()
        retry_after = int(refused["Retry-After"])
        assert refused.status_code == 429 and 60 <= retry_after <= 61
        clock.move_to(T0 + timedelta(seconds=retry_after - 1))
        assert call().status_code == 429
        clock.move_to(T0 + timedelta(seconds=retry_after))
        assert call().status_code == 200


def test_the_previous_window_counts_by_the_share_of_it_still_inside_the_sliding_minute(call):
    with time_machine.travel(T0 + timedelta(seconds=30), tick=False) as clock:
        assert [call().status_code for _ in range(4)] == [200] * 4
        # 15 s into the next window: 4 × 45/60 = 3 of the last minute's requests still count.
        clock.move_to(T0 + timedelta(seconds=75))
        assert [call().status_code for _ in range(3)] == [200, 200, 429]
        # Refused requests are not counted: as the previous window slides out, room comes back.
        clock.move_to(T0 + timedelta(seconds=105))  # 4 × 15/60 = 1, + 2 this window
        assert [call().status_code for _ in range(3)] == [200, 200, 429]


def test_the_cache_holds_one_counter_per_window_however_many_requests_were_made(call, monkeypatch):
    """DRF's log kept every request's time in one entry (18,000 at 300/s under 100000/min)."""
    monkeypatch.setattr(FivePerMinute, "rate", "100000/min")
    user = get_user_model().objects.get(username="ada")
    key = FivePerMinute.cache_format % {"scope": "user", "ident": user.pk}
    window = int(T0.timestamp() // 60)
    with time_machine.travel(T0 + timedelta(seconds=10), tick=False):
        for _ in range(300):
            assert call().status_code == 200
        assert cache.get(f"{key}:{window}") == 300
        assert cache.get(key) is None and cache.get(f"{key}:{window - 1}") is None  # no log, no other window


# --- the client's address (anonymous throttles) -----------------------------------------------


@pytest.mark.parametrize(
    ("trusted", "peer", "forwarded", "expected"),
    [
        ([], "10.0.0.5", "203.0.113.9", "10.0.0.5"),  # no trusted proxy: a forged X-Forwarded-For is ignored
        ([], "10.0.0.5", None, "10.0.0.5"),
        (["10.0.0.0/24"], "10.0.0.5", "203.0.113.9, 198.51.100.7", "198.51.100.7"),  # the entry our proxy appended
        (["10.0.0.0/24"], "10.0.0.5", None, "10.0.0.5"),
        # A client that reaches gunicorn directly (not from the proxies' network) is its own address,
        # whatever it writes: the hop count (NODEPOOL_PROXY_COUNT) believed anyone.
        (["10.0.0.0/24"], "198.51.100.66", "203.0.113.9", "198.51.100.66"),
        # Two trusted hops (a load balancer, then nginx): the rightmost address that is not one.
        (["10.0.0.0/24", "10.1.0.0/16"], "10.0.0.5", "6.6.6.6, 203.0.113.9, 10.1.2.3", "203.0.113.9"),
        (["10.0.0.0/24"], "10.0.0.5", "203.0.113.9, not-an-address", "10.0.0.5"),
        (["10.0.0.0/24", "::1"], "::1", "2001:db8::7", "2001:db8::7"),
    ],
)
def test_the_client_address_is_the_one_our_trusted_proxies_saw_not_one_the_client_chose(
    trusted, peer, forwarded, expected, settings
):
    from rest_framework.throttling import AnonRateThrottle

    from nodepool.proxies import TrustedProxyMiddleware

    settings.NODEPOOL_TRUSTED_PROXIES = trusted
    meta = {"REMOTE_ADDR": peer} | ({"HTTP_X_FORWARDED_FOR": forwarded} if forwarded else {})
    request = APIRequestFactory().get("/api/v1/", **meta)
    assert client_address(request) == expected  # the login lockout's (AXES_CLIENT_IP_CALLABLE), unmiddlewared
    TrustedProxyMiddleware(lambda r: None)(request)
    assert settings.REST_FRAMEWORK["NUM_PROXIES"] == 0
    assert AnonRateThrottle().get_ident(request) == client_address(request) == expected
    assert request.META["NODEPOOL_PEER_ADDR"] == peer
    assert settings.AXES_CLIENT_IP_CALLABLE == "nodepool.api.throttling.client_address"


def test_the_retired_proxy_count_stops_the_start_with_a_pointer_to_its_replacement():
    import os
    import subprocess
    import sys

    env = {**os.environ, "NODEPOOL_PROXY_COUNT": "1", "DJANGO_SETTINGS_MODULE": "nodepool.settings"}
    out = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"], env=env, capture_output=True, text=True
    )
    assert out.returncode != 0 and "NODEPOOL_TRUSTED_PROXIES" in out.stderr
