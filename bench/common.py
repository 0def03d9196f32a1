"""Helpers every benchmark uses. Small API, on purpose:

``prepare_database(url)``          create the PostgreSQL database if missing and migrate it
``django_setup(url)``              configure Django in this process against ``url`` (before any model import)
``Gunicorn(url, workers=2)``       context manager: gunicorn on a free port with ``DATABASE_URL`` and
                                   ``NODEPOOL_BENCH=1`` (which serves the baseline views); ``.base`` is its URL
``Nginx(upstream)``                context manager: nginx on a free port in front of ``upstream`` (``host:port``)
                                   with the shipped deploy/nginx/nodepool.conf.template; ``.base`` is its URL
``wrk(base, script, duration=, connections=, threads=, env=)``
                                   run ``wrk`` with a Lua script; returns the JSON the script's ``done()``
                                   prints (``requests``, ``rps``, ``p50_ms``, ``p99_ms``, plus counters)
``WRK_LUA_LIB``                    Lua snippet defining ``done()`` that prints that JSON line; scripts
                                   append it and count with ``counters[name] = (counters[name] or 0) + 1``;
                                   ``verification_call()`` tells wrk's check of request() from a real one
``percentile(values, p)``          for in-process timings
``emit(figures)``                  print the final one-line JSON every bench ends with

The baselines the issue asks for are bare Django views served by the same gunicorn
(nodepool/bench_views.py): ``POST /bench/one-update/<node id>`` parses the JSON body and runs one
UPDATE (bench/heartbeats.py); ``POST /bench/one-grant`` runs a grant's transaction, the conditional
capacity UPDATE plus the INSERT of a lease row (bench/placement.py).
``wrk`` comes from ``apt-get install -y wrk``; nothing here falls back to a Python client because
a Python load generator on a 2-core machine would measure itself more than the server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/np_heartbeats_bench"


def bench_env(database_url: str, **extra: str) -> dict[str, str]:
    """The environment of a benchmarked process: the database, bench mode, no debug, quiet logs."""
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        NODEPOOL_BENCH="1",
        DEBUG="0",
        LOG_LEVEL="WARNING",
        CONN_MAX_AGE="600",
        DJANGO_SETTINGS_MODULE="nodepool.settings",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def prepare_database(database_url: str) -> None:
    """Create the database named in ``database_url`` (PostgreSQL) if needed, then migrate it."""
    import psycopg

    parsed = urlparse(database_url)
    name = parsed.path.lstrip("/")
    admin = parsed._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    subprocess.run(
        [PYTHON, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=bench_env(database_url), check=True
    )


def django_setup(database_url: str) -> None:
    """Point this process's Django at ``database_url`` (call before importing models)."""
    os.environ.update(bench_env(database_url))
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_group(process: subprocess.Popen | None, *, timeout: float) -> None:
    """SIGTERM the process group ``process`` leads (started with ``start_new_session``); SIGKILL
    it if it is still there after ``timeout`` seconds."""
    if process and process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


class Gunicorn:
    """gunicorn serving nodepool on a free port; stops its process group on exit."""

    def __init__(self, database_url: str, *, workers: int = 2, extra_env: dict | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = bench_env(database_url, **(extra_env or {}))
        self.workers = workers
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Gunicorn:
        gunicorn = str(Path(PYTHON).with_name("gunicorn"))
        self.process = subprocess.Popen(
            [
                gunicorn,
                "nodepool.wsgi:application",
                "-w",
                str(self.workers),
                "-b",
                f"127.0.0.1:{self.port}",
                "--log-level",
                "warning",
                "--backlog",
                "2048",
            ],  # fmt: skip
            cwd=ROOT,
            env=self.env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.base + "/healthz", timeout=1) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError("gunicorn did not start")

    def __exit__(self, *exc) -> None:
        stop_group(self.process, timeout=15)


NGINX_TEMPLATE = ROOT / "deploy" / "nginx" / "nodepool.conf.template"


def render_nginx_conf(
    upstream: str,
    listen_port: int,
    work_dir: Path,
    *,
    node_rate_per_address: str = "200r/s",
    probe_upstream: str | None = None,
) -> Path:
    """Write a whole nginx.conf into ``work_dir`` around the shipped http-context template.

    Only the template's ``${NODEPOOL_...}`` are substituted, as the nginx image's envsubst does
    with the variables compose defines: the upstream (a host name is resolved now, from
    /etc/hosts, so the resolver is never asked), the resolver and ``node_rate_per_address``
    (compose's default, 200r/s), and ``probe_upstream`` (where ``/healthz`` goes: gunicorn's
    master probe, ``NODEPOOL_PROBE_BIND``; by default ``upstream`` itself); the template's ``listen 8080`` becomes
    ``listen 127.0.0.1:<listen_port>``. Paths (pid, logs, temporary files) stay inside
    ``work_dir``, so no root is needed.
    """
    host, _, port = upstream.rpartition(":")
    upstream = f"{socket.gethostbyname(host)}:{port}"  # e.g. localhost: there is no DNS server to ask
    if probe_upstream is None:
        probe_upstream = upstream
    else:
        probe_host, _, probe_port = probe_upstream.rpartition(":")
        probe_upstream = f"{socket.gethostbyname(probe_host)}:{probe_port}"
    text = NGINX_TEMPLATE.read_text()
    for name, value in (
        ("UPSTREAM", upstream),
        ("PROBE_UPSTREAM", probe_upstream),
        ("RESOLVER", "127.0.0.1"),
        ("NODE_RATE_PER_ADDRESS", node_rate_per_address),
    ):
        text = text.replace("${NODEPOOL_" + name + "}", value)
    if "listen 8080;" not in text or "${" in text:
        raise RuntimeError(f"{NGINX_TEMPLATE} no longer has the shape render_nginx_conf expects")
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{listen_port};")
    (work_dir / "nodepool.conf").write_text(text)
    user = ""
    if os.geteuid() == 0:  # workers would drop to nobody, who cannot write work_dir's temp paths
        user = "user root;"
    conf = work_dir / "nginx.conf"
    conf.write_text(
        f"""{user}
worker_processes 1;
daemon off;
pid {work_dir}/nginx.pid;
error_log {work_dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {work_dir}/client_body;
    proxy_temp_path {work_dir}/proxy;
    fastcgi_temp_path {work_dir}/fastcgi;
    uwsgi_temp_path {work_dir}/uwsgi;
    scgi_temp_path {work_dir}/scgi;
    include {work_dir}/nodepool.conf;
}}
"""
    )
    return conf


def nginx_binary() -> str | None:
    """nginx's path (Debian installs it in /usr/sbin, not always on a user's PATH), or None."""
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


class Nginx:
    """nginx (``apt-get install -y nginx``) on a free port in front of ``upstream`` (``host:port``),
    configured by the shipped template (docker-compose.yml's proxy); stops on exit."""

    def __init__(self, upstream: str, *, node_rate_per_address: str = "200r/s", probe_upstream: str | None = None):
        self.binary = nginx_binary()
        if self.binary is None:
            raise RuntimeError("nginx is not installed: apt-get install -y nginx")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.work_dir = Path(tempfile.mkdtemp(prefix="nodepool-nginx-"))
        self.conf = render_nginx_conf(
            upstream,
            self.port,
            self.work_dir,
            node_rate_per_address=node_rate_per_address,
            probe_upstream=probe_upstream,
        )
        self.process: subprocess.Popen | None = None

    def check(self) -> subprocess.CompletedProcess:
        """``nginx -t`` on the rendered configuration (returncode 0 when nginx accepts it)."""
        return subprocess.run([self.binary, "-t", "-c", str(self.conf)], capture_output=True, text=True)

    def __enter__(self) -> Nginx:
        self.process = subprocess.Popen([self.binary, "-c", str(self.conf)], start_new_session=True,
                                        stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        log = (self.work_dir / "error.log").read_text() if (self.work_dir / "error.log").exists() else ""
        self.__exit__(None, None, None)
        raise RuntimeError(f"nginx did not start:\n{log}")

    def __exit__(self, *exc) -> None:
        stop_group(self.process, timeout=10)
        shutil.rmtree(self.work_dir, ignore_errors=True)


WRK_LUA_LIB = r"""
counters = {}
local threads = {}
function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end
-- wrk calls request() once more in thread 0's state, right after init(), only to check what it
-- returns (script_verify_request); that request is never sent. A script that hands out nodes in
-- turn starts request() with `if verification_call() then return wrk.format("GET", "/") end`, so
-- that this call takes no node's turn (else thread 0's first node would be skipped every run).
local verified = false
function verification_call()
  if tid == 0 and not verified then verified = true; return true end
  return false
end
local function json_escape(s) return (tostring(s):gsub('[%c"\\]', '')) end
function done(summary, latency, requests)
  local merged = {}
  for _, t in ipairs(threads) do
    local c = t:get("counters")
    if c then for k, v in pairs(c) do merged[k] = (merged[k] or 0) + v end end
  end
  local parts = {}
  for k, v in pairs(merged) do table.insert(parts, string.format('"%s": %d', json_escape(k), v)) end
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.status + summary.errors.timeout
  io.write(string.format(
    'WRKJSON {"requests": %d, "seconds": %.3f, "rps": %.1f, "p50_ms": %.3f, "p90_ms": %.3f, "p99_ms": %.3f, '
      .. '"max_ms": %.3f, "socket_errors": %d, "non_2xx": %d, "counters": {%s}}\n',
    summary.requests, summary.duration / 1e6, summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(90) / 1000, latency:percentile(99) / 1000,
    latency.max / 1000, errors, summary.errors.status, table.concat(parts, ", ")))
end
"""


def wrk(
    base: str,
    script: str,
    *,
    duration: float = 10,
    connections: int = 16,
    threads: int = 2,
    env: dict | None = None,
) -> dict:
    """Run wrk against ``base`` with Lua ``script`` (append :data:`WRK_LUA_LIB`); returns its JSON.

    ``env`` is passed to wrk (Lua reads it with ``os.getenv``), e.g. the path of a file of nodes.
    """
    if not shutil.which("wrk"):
        raise RuntimeError("wrk is not installed: apt-get install -y wrk")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(script)
        path = handle.name
    try:
        output = subprocess.run(
            [
                "wrk",
                "-t",
                str(threads),
                "-c",
                str(connections),
                "-d",
                f"{max(1, round(duration))}s",
                "--timeout",
                "10s",
                "-s",
                path,
                base,
            ],  # fmt: skip
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            check=False,
        )
    finally:
        os.unlink(path)
    line = next((x for x in output.stdout.splitlines() if x.startswith("WRKJSON ")), None)
    if output.returncode or line is None:
        raise RuntimeError(f"wrk failed ({output.returncode}):\n{output.stdout}\n{output.stderr}")
    return json.loads(line[len("WRKJSON ") :])


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (0–100) of ``values`` by nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def emit(figures: dict) -> None:
    """Print the one JSON line every benchmark ends with."""
    print(json.dumps(figures, default=str), flush=True)
