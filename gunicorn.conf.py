"""gunicorn settings read from the working directory by every ``gunicorn`` start (Procfile, Docker,
the demo, the tests). Command-line flags still win.

Header limits: the application refuses a header above ``NODEPOOL_MAX_HEADER_BYTES`` (8 KiB) with
431 problem+json (nodepool.api.middleware.HeaderLimitMiddleware). gunicorn's own limits are set
above the application's so that it sees such requests; beyond them gunicorn answers with its own
plain-text 400/431 page before any application code runs (documented in docs/foundation.md).
"""

limit_request_field_size = 16384  # bytes per header line (gunicorn's default 8190 < our limit)
limit_request_fields = 100  # headers per request (gunicorn's default)
limit_request_line = 8190  # request line (method, path, query); gunicorn's maximum


# --- /healthz from the master process (issue 30, item 2) ------------------------------------------
# With NODEPOOL_PROBE_BIND=host:port, gunicorn's master answers GET /healthz there from a thread of
# its own: no request stuck in a worker (a hung database holds a sync worker up to the request's
# database deadline) can queue in front of it. It says what /healthz always said, that the server
# is up, and it is the master that restarts stuck or dead workers. Standard library only: the
# master never loads Django. Compose's nginx sends /healthz there (docs/foundation.md, "Probes").
def when_ready(server):
    import os

    bind = os.environ.get("NODEPOOL_PROBE_BIND", "")
    if bind:
        _serve_health(bind, server)


def _serve_health(bind, server):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    problems = "https://nodepool.dev/problems/"

    class Health(BaseHTTPRequestHandler):
        def do_GET(self, head=False):
            if self.path.split("?", 1)[0] != "/healthz":
                status, body = 404, {"type": problems + "not-found", "title": "Not found", "status": 404,
                                     "detail": "Not found.", "code": "not_found"}  # fmt: skip
            elif self.command not in ("GET", "HEAD"):
                status, body = 405, {"type": problems + "method-not-allowed", "title": "Method not allowed",
                                     "status": 405, "detail": f'Method "{self.command}" not allowed.',
                                     "code": "method_not_allowed"}  # fmt: skip
            else:
                status, body = 200, {"status": "ok", "workers": len(server.WORKERS)}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if status == 200 else "application/problem+json")
            self.send_header("Content-Length", str(len(data)))
            if status == 405:
                self.send_header("Allow", "GET, HEAD")
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def do_HEAD(self):
            self.do_GET(head=True)

        do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET

        def log_message(self, *args):
            pass

    host, _, port = bind.rpartition(":")
    httpd = ThreadingHTTPServer((host.strip("[]") or "127.0.0.1", int(port)), Health)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="nodepool-probe", daemon=True).start()
    server.log.info("nodepool probe: /healthz on %s", bind)
