"""The shipped nginx configuration (deploy/nginx) in front of the real application.

docker-compose.yml publishes only this proxy. Each node credential gets its own request bucket
there, so one node with many requests in flight waits at the proxy instead of ahead of every
other node in gunicorn's queue (issue: no node can starve another). These tests start nginx with
the very file compose mounts (rendered by bench.common.Nginx) in front of pytest-django's live
server, and send real HTTP through it. nginx comes from ``apt-get install -y nginx`` (.ci/run).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from datetime import UTC, datetime

import httpx
import pytest

from bench.common import Nginx, nginx_binary
from fleet.models import Node
from tests.control_plane import ControlPlane
from tests.factories import PoolFactory, make_schedulable_node
from tests.processes import free_port

pytestmark = [
    pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (apt-get install -y nginx)"),
    pytest.mark.django_db(transaction=True),
]

# The shipped buckets (the template): per node credential 10/s, 20 at once beyond the first, 200
# more waiting; per address, requests without any Authorization 50/s, 100 at once beyond the first.
RATE = 10
IMMEDIATE = 1 + 20
WAITING = 200
ANONYMOUS_IMMEDIATE = 1 + 100
ANONYMOUS_RATE = 50


@pytest.fixture
def proxy(live_server):
    upstream = live_server.url.removeprefix("http://")
    with Nginx(upstream) as nginx:
        yield nginx


@pytest.fixture
def bare_proxy():
    """The proxy in front of an upstream that answers 200 at once (a thread per connection): for
    what the buckets hold, without the application's own pace in the figures."""
    import socketserver
    import threading

    class Answer(socketserver.StreamRequestHandler):
        def handle(self):
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        request_queue_size = 1024  # the default 5 would queue the proxy's connections here instead

    server = Server(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Nginx(f"127.0.0.1:{server.server_address[1]}") as nginx:
            yield nginx
    finally:
        server.shutdown()
        server.server_close()


def fake_credential(prefix: str, variant: int = 0, secret: str = "secret") -> str:
    """A ``Node`` Authorization header for ``npn_<prefix>.<secret>``. The proxy keys on the whole
    credential, split on ASCII whitespace as the application splits it, so the spacing may vary
    (``variant``) and the requests still count in one bucket."""
    spacing = (" ", "  ", "\t")[variant % 3]
    return f"Node{spacing}npn_{prefix}.{secret}"


async def fire(base: str, headers: list[dict], *, wait: float) -> tuple[list[httpx.Response], int]:
    """Send one GET /healthz per headers dict, all at once; after ``wait`` seconds, cancel what
    has not been answered (the proxy drops a waiting request whose client went away).

    Returns ``(responses received, number still waiting when cancelled)``.
    """
    limits = httpx.Limits(max_connections=len(headers) + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:
        tasks = [asyncio.create_task(client.get("/healthz", headers=h)) for h in headers]
        done, pending = await asyncio.wait(tasks, timeout=wait)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [task.result() for task in done], len(pending)


def test_nginx_accepts_the_shipped_configuration(live_server):
    nginx = Nginx(live_server.url.removeprefix("http://"))
    try:
        result = nginx.check()
    finally:
        shutil.rmtree(nginx.work_dir, ignore_errors=True)
    assert result.returncode == 0, result.stderr


def test_a_node_renews_through_the_proxy_and_the_applications_answers_pass_untouched(proxy):
    node, secret = make_schedulable_node(PoolFactory(name="general"))
    url = f"{proxy.base}/api/v1/nodes/{node.pk}/renewals"
    headers = {"Authorization": f"Node {secret}"}

    applied = httpx.post(url, json={"incarnation": node.incarnation, "sequence": node.sequence + 1}, headers=headers)
    too_soon = httpx.post(url, json={"incarnation": node.incarnation, "sequence": node.sequence + 2}, headers=headers)
    stranger = httpx.post(url, json={"incarnation": 1, "sequence": 1}, headers={"Authorization": "Node npn_x.y"})

    assert applied.status_code == 200 and applied.json()["applied"] is True
    # The application's own 429 (its flood guard) with its own Retry-After, not the proxy's.
    assert too_soon.status_code == 429 and too_soon.headers["content-type"] == "application/problem+json"
    assert int(too_soon.headers["retry-after"]) > 1 and "retry_after" in too_soon.json()
    assert stranger.status_code == 401 and stranger.json()["code"] == "authentication_failed"


def test_the_agent_enrolls_reports_and_renews_through_the_proxy(proxy, tmp_path, monkeypatch, time_machine):
    import agent.runner as runner
    from agent.runner import Agent, AgentConfig

    cp = ControlPlane(heartbeat_interval=10)
    now = {"t": 1000.0}
    time_machine.move_to(datetime.now(UTC), tick=False)
    monkeypatch.setattr(runner.time, "monotonic", lambda: now["t"])
    config = AgentConfig(url=proxy.base, state_path=tmp_path / "state.json", bootstrap_token=cp.token,
                         work_dir=tmp_path / "work", stop_grace=2.0)  # fmt: skip
    agent = Agent(config, rng=random.Random(7))
    agent.start()
    try:
        for _ in range(4):
            agent.step()
            now["t"] += 10
            time_machine.shift(10)
    finally:
        agent.shutdown()

    node = Node.objects.get(pk=agent.state.node_id)
    # Enrollment, a status report, then renewals (and a report when a flag asked), all through
    # nginx: each of the four steps was applied, none refused on the way.
    assert node.sequence == agent.state.sequence >= 4
    assert node.incarnation == agent.state.incarnation and node.liveness == "alive"


def test_a_flooding_credential_waits_at_the_proxy_while_another_node_goes_straight_through(proxy):
    async def scenario():
        flood = asyncio.create_task(fire(proxy.base, [{"Authorization": fake_credential("f100d")}] * 80, wait=2))
        await asyncio.sleep(0.3)  # the flood is in: its bucket is full and its requests wait
        async with httpx.AsyncClient(base_url=proxy.base, timeout=10) as client:
            other = await client.get("/healthz", headers={"Authorization": fake_credential("0ther")})
            # The flooder's prefix with another secret: the prefix shows in events and to
            # schedulers, so it must not be enough to spend (or use) the flooder's bucket.
            same_prefix = await client.get("/healthz", headers={"Authorization": fake_credential("f100d", 0, "x")})
            plain = await client.get("/healthz")
        return other, same_prefix, plain, await flood

    other, same_prefix, plain, (flooded, still_waiting) = asyncio.run(scenario())

    assert other.status_code == same_prefix.status_code == plain.status_code == 200
    assert other.elapsed.total_seconds() < 1 and same_prefix.elapsed.total_seconds() < 1
    # At 10/s, about 21 + 10 × 2 of the flooder's 80 were let through in 2 s; the rest still waited.
    assert all(r.status_code == 200 for r in flooded)
    assert len(flooded) <= IMMEDIATE + RATE * 2 + 3
    assert still_waiting == 80 - len(flooded)


def test_beyond_its_waiting_room_a_credential_gets_the_proxys_429_problem_json(bare_proxy):
    count = IMMEDIATE + WAITING + 60  # 60 beyond the waiting room, some of it drained meanwhile
    headers = [{"Authorization": fake_credential("b0057", i), "X-Request-ID": f"flood-{i}"} for i in range(count)]

    responses, still_waiting = asyncio.run(fire(bare_proxy.base, headers, wait=2))

    refused = [r for r in responses if r.status_code == 429]
    assert len(refused) >= 15, [r.status_code for r in responses]
    for response in refused:
        assert response.headers["retry-after"] == "1"
        body = assert_proxy_problem(response, 429, "too_many_requests")
        assert body["request_id"] == response.headers["x-request-id"] and body["request_id"].startswith("flood-")
    assert still_waiting >= WAITING - RATE * 2 - 60  # the bucket's waiting room held the rest


def test_an_address_sending_no_credential_has_a_bucket_of_its_own(bare_proxy):
    import time

    count = 300
    started = time.monotonic()
    responses, still_waiting = asyncio.run(fire(bare_proxy.base, [{}] * count, wait=60))
    took = time.monotonic() - started

    assert still_waiting == 0 and {r.status_code for r in responses} == {200}
    # 101 at once, the rest let through at 50/s: about 4 s, however fast the client and upstream.
    assert took >= (count - ANONYMOUS_IMMEDIATE - 10) / ANONYMOUS_RATE


def test_requests_with_a_user_token_are_left_to_the_applications_throttle(proxy):
    responses, still_waiting = asyncio.run(fire(proxy.base, [{"Authorization": "Token some-user-token"}] * 40, wait=10))

    assert still_waiting == 0 and len(responses) == 40
    assert {r.status_code for r in responses} == {200}


def assert_proxy_problem(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text[:300]
    assert response.headers["content-type"] == "application/problem+json"
    body = response.json()
    assert body["status"] == status and body["code"] == code
    assert body["type"] == "https://nodepool.dev/problems/" + code.replace("_", "-")
    return body


def test_what_nginx_refuses_itself_is_problem_json_too_and_the_applications_refusals_pass(proxy):
    url = f"{proxy.base}/api/v1/nodes"
    json_headers = {"Content-Type": "application/json"}

    app_body = httpx.post(url, content=b"[" + b"0," * 150_000 + b"0]", headers=json_headers)
    proxy_body = httpx.post(url, content=b"0" * (1024 * 1024 + 1), headers=json_headers)
    proxy_header = httpx.get(url, headers={"X-Padding": "x" * 9000})
    proxy_uri = httpx.get(f"{url}?q={'x' * 9000}")

    # 300 KB: above the application's limit (256 KiB), below the proxy's (1 MiB): the app answers.
    assert assert_proxy_problem(app_body, 413, "payload_too_large")["limit"] == 256 * 1024
    assert assert_proxy_problem(proxy_body, 413, "payload_too_large")["limit"] == 1024 * 1024
    assert_proxy_problem(proxy_header, 431, "header_too_large")
    assert_proxy_problem(proxy_uri, 414, "uri_too_long")


def test_a_web_tier_that_does_not_answer_is_a_502_problem_with_retry_after():
    with Nginx(f"127.0.0.1:{free_port()}") as nginx:  # nothing listens there
        response = httpx.post(f"{nginx.base}/api/v1/nodes/x/renewals", json={}, timeout=10)

    assert_proxy_problem(response, 502, "upstream_unavailable")
    assert response.headers["retry-after"] == "5"


def raw(base: str, request: bytes) -> tuple[int, dict, bytes]:
    """Send ``request`` as bytes (what httpx would refuse to write); returns status, headers, body."""
    import socket

    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GET /healthz HTTP/1.0\r\n\r\n", 400, "bad_request"),  # no Host: links would name the upstream
        (b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "bad_request"),
        (b"POST /api/v1/nodes HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "bad_request"),
        (b"POST /api/v1/nodes HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "not_implemented"),
        (b"GET /healthz HTTP/2.0\r\nHost: a\r\n\r\n", 505, "http_version_not_supported"),
        (b"TRACE /healthz HTTP/1.1\r\nHost: a\r\n\r\n", 405, "method_not_allowed"),
    ],
    ids=["no-host", "two-hosts", "bad-chunk", "gzip-encoding", "http2-line", "trace"],
)
def test_requests_nginx_cannot_read_get_problem_json_not_its_html_pages(proxy, request_bytes, status, code):
    got, headers, body = raw(proxy.base, request_bytes)

    assert got == status, body[:300]
    assert headers["content-type"] == "application/problem+json"
    problem = json.loads(body)
    assert problem["status"] == status and problem["code"] == code
    assert problem["request_id"] == headers["x-request-id"]


@pytest.mark.parametrize(
    ("header", "value"),
    [("User-Agent", b"agent\x7f1"), ("Authorization", b"Node npn_a.b\x01"), ("X-Request-ID", b"id\x1b"),
     ("Cookie", b"sessionid=\x08x")],
    ids=["del-user-agent", "soh-authorization", "esc-request-id", "bs-cookie"],
)  # fmt: skip
def test_a_control_byte_in_a_header_value_is_refused_by_nginx_as_the_application_refuses_it(proxy, header, value):
    head = b"GET /api/v1/nodes HTTP/1.1\r\nHost: a\r\nConnection: close\r\n"
    request = head + header.encode() + b": " + value + b"\r\n\r\n"
    got, headers, body = raw(proxy.base, request)

    assert got == 400, body[:300]
    assert headers["content-type"] == "application/problem+json"
    problem = json.loads(body)
    assert problem["code"] == "invalid_header_value" and problem["status"] == 400
    assert problem["type"] == "https://nodepool.dev/problems/invalid-header-value"
    assert problem["title"] == "Invalid header value"  # the application's declared title
    assert problem["request_id"] == headers["x-request-id"]


def test_a_header_the_application_does_not_read_is_not_passed_on_so_its_bytes_never_reach_gunicorn(proxy):
    # gunicorn would answer its own HTML 400 for the DEL; the proxy passes on only what the
    # application reads (each checked), so this request is answered by the application.
    request = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nX-Custom: a\x7fb\r\n\r\n"
    got, headers, body = raw(proxy.base, request)

    assert got == 200, body[:300]


def test_nginx_405_names_the_methods_it_passes_on_in_allow(proxy):
    got, headers, body = raw(proxy.base, b"TRACE /api/v1/nodes HTTP/1.1\r\nHost: a\r\n\r\n")

    assert got == 405 and json.loads(body)["code"] == "method_not_allowed"
    assert headers["allow"] == "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"


@pytest.mark.parametrize("path", ["/_nodepool/problems/400", "/_nodepool/problems/502", "/_nodepool/problems/404"])
def test_the_proxys_internal_locations_answer_404_problem_json_from_outside(proxy, path):
    response = httpx.get(proxy.base + path, headers={"X-Request-ID": "outside-1"})

    body = assert_proxy_problem(response, 404, "not_found")
    assert body["request_id"] == response.headers["x-request-id"] == "outside-1"


def test_healthz_goes_to_the_probe_upstream_not_to_the_workers(live_server):
    import socketserver
    import threading

    class Probe(socketserver.StreamRequestHandler):
        def handle(self):
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            body = b'{"status": "ok", "from": "probe"}'
            head = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            self.wfile.write(head % len(body))
            self.wfile.write(body)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Probe)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        upstream = live_server.url.removeprefix("http://")
        with Nginx(upstream, probe_upstream=f"127.0.0.1:{server.server_address[1]}") as nginx:
            health = httpx.get(nginx.base + "/healthz")
            api = httpx.get(nginx.base + "/api/v1/nodes")
    finally:
        server.shutdown()
        server.server_close()

    assert health.status_code == 200 and health.json()["from"] == "probe"
    assert api.status_code == 401  # everything else still goes to the workers
