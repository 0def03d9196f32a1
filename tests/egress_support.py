"""Outbound-call helpers (nodepool.egress): a stub resolver and a loopback receiver.

``stub_dns(monkeypatch, {"metadata.google.internal": ["169.254.169.254"]})`` makes names resolve
without DNS (names such as metadata.google.internal do not resolve here); a list of lists answers
the first list to the first lookup, the second to the second (DNS rebinding). IP literals resolve
to themselves. ``allow_loopback(settings)`` lets tests call a receiver on 127.0.0.1, as an
operator whose provider runs inside their network would set ``NODEPOOL_EGRESS_ALLOW``.
"""

from __future__ import annotations

import ipaddress
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def stub_dns(monkeypatch, names: dict) -> list[str]:
    """Replace ``nodepool.egress.resolve``; returns the list of names looked up, in order."""
    from nodepool import egress

    lookups: list[str] = []
    answers = {name: list(value) for name, value in names.items()}

    def resolve(host: str, port: int):
        lookups.append(host)
        try:
            return [ipaddress.ip_address(host)]
        except ValueError:
            pass
        if host not in answers:
            raise egress.EgressError("name does not resolve")
        value = answers[host]
        if value and isinstance(value[0], list):  # one answer per lookup, the last one repeated
            value = value.pop(0) if len(value) > 1 else value[0]
        return [ipaddress.ip_address(a) for a in value]

    monkeypatch.setattr(egress, "resolve", resolve)
    return lookups


def allow_loopback(settings) -> None:
    settings.NODEPOOL_EGRESS_ALLOW = ["127.0.0.0/8", "::1"]


class Receiver:
    """An HTTP server on 127.0.0.1 answering every request with ``status``, ``body`` and
    ``headers``; ``requests`` holds ``(method, path, body)`` of each request it received, and
    ``request_headers`` the headers of each (a dict, in the same order)."""

    def __init__(self, status: int = 200, body: bytes = b"{}", headers: dict | None = None):
        self.status, self.body, self.headers, self.requests = status, body, headers or {}, []
        self.request_headers: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                receiver.requests.append((self.command, self.path, self.rfile.read(length)))
                receiver.request_headers.append(dict(self.headers.items()))
                self.send_response(receiver.status)
                for name, value in receiver.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(receiver.body)))
                self.end_headers()
                self.wfile.write(receiver.body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
