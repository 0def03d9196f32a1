"""Schema conformance in CI: schemathesis against a live nodepool in three roles.

Starts a fresh control plane (its own SQLite database and embedded broker under a temporary
directory, gunicorn on a free loopback port), seeds one run's fixtures (.ci/schemathesis_seed.py)
and runs ``st run`` with every check enabled, as the operator, the node and the marketplace owner.
Operations that would cut the fuzzing roles off (revoking or rotating credentials, quarantine,
retire) are left out of those runs and fuzzed last, in a separate phase, by the operator.

Then once more as the operator through the shipped nginx (deploy/nginx, rendered by
bench.common.Nginx as compose mounts it), so that what the proxy answers itself (its problem+json
refusals, 405, /healthz from gunicorn's master probe) is checked against the schema too
(``ST_PROXY_SECONDS``, default 40 s; skipped with a notice when nginx is not installed).

Bounded: ``--max-time`` per phase (``ST_SECONDS``, default 45 s) keeps the whole step near 5 minutes.
Exit status: non-zero when any phase reports a failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench.common (nginx rendered from the shipped template)
from bench.common import Nginx, nginx_binary  # noqa: E402 - needs ROOT on sys.path

BIN = Path(sys.executable).parent
DESTRUCTIVE = r".*/(credentials/revoke|credentials/rotate|credentials|quarantine|retire|release|revoke)$"
# Log out everywhere would revoke the fuzzing role's own token: not fuzzed (tests/plumbing/test_token_lifetimes.py).
NOT_FUZZED = DESTRUCTIVE.replace("|revoke)$", "|revoke|logout-everywhere)$")
SECONDS = int(os.environ.get("ST_SECONDS", "45"))
EXAMPLES = os.environ.get("ST_MAX_EXAMPLES", "25")
PROXY_SECONDS = int(os.environ.get("ST_PROXY_SECONDS", "40"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    var = Path(tempfile.mkdtemp(prefix="nodepool-st-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "DATABASE_", "DJANGO_"))}
    env.update(
        NODEPOOL_VAR_DIR=str(var),
        SECRET_KEY="schemathesis-run-only",
        THROTTLE_ANON="100000/min",
        THROTTLE_USER="10000000/min",
        THROTTLE_ENROLLMENT="100000/min",
        NODEPOOL_CREDENTIAL_ROTATION_OVERLAP="3600",
        NODEPOOL_CREDENTIAL_ROTATIONS_PER_HOUR="100000",
        # Its checks send made-up credentials by the hundred from one address (nodepool.auth_failures).
        NODEPOOL_AUTH_FAILURE_LIMIT="0",
        PYTHONUNBUFFERED="1",
    )
    probe_port = free_port()
    env["NODEPOOL_PROBE_BIND"] = f"127.0.0.1:{probe_port}"  # gunicorn's master answers /healthz
    python = str(BIN / "python")
    subprocess.run([python, "manage.py", "migrate", "--noinput", "-v0"], cwd=ROOT, env=env, check=True)
    seed = subprocess.run(
        [python, "manage.py", "shell", "-c", (ROOT / ".ci" / "schemathesis_seed.py").read_text()],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    fixtures = json.loads(seed.stdout.strip().splitlines()[-1])
    port = free_port()
    log = open(var / "gunicorn.log", "wb")  # noqa: SIM115 - closed in the finally below
    server = subprocess.Popen(
        [str(BIN / "gunicorn"), "nodepool.wsgi:application", "--bind", f"127.0.0.1:{port}", "--workers", "2"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    proxy = None
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(base + "/healthz", timeout=2)  # noqa: S310 - our own http:// URL
                break
            except OSError:
                time.sleep(0.2)
        phases = [
            ("operator", f"Token {fixtures['operator']}", ["--exclude-path-regex", NOT_FUZZED]),
            ("node", f"Node {fixtures['node']}", ["--exclude-path-regex", NOT_FUZZED]),
            ("owner", f"Token {fixtures['owner']}", ["--exclude-path-regex", NOT_FUZZED]),
            ("destructive (operator)", f"Token {fixtures['operator']}", ["--include-path-regex", DESTRUCTIVE]),
            ("operator, through nginx", f"Token {fixtures['operator']}", ["--exclude-path-regex", DESTRUCTIVE]),
        ]
        proxy = None
        if nginx_binary() is not None:
            proxy = Nginx(f"127.0.0.1:{port}", probe_upstream=f"127.0.0.1:{probe_port}")
            proxy.__enter__()
        failed = []
        for name, authorization, selection in phases:
            print(f"\n== schemathesis as {name}", flush=True)
            if name == "operator, through nginx" and proxy is None:
                print("nginx is not installed: phase skipped (apt-get install -y nginx)", flush=True)
                continue
            target = proxy.base if name == "operator, through nginx" else base
            command = [
                str(BIN / "st"), "run", f"{target}/api/schema/",
                "--header", f"Authorization: {authorization}",
                "--checks", "all",
                "--phases", "examples,coverage,fuzzing",
                "--max-examples", EXAMPLES,
                "--max-time", str(PROXY_SECONDS if name == "operator, through nginx" else SECONDS),
                "--workers", "1",  # two threads tripped a hypothesis AST race on Python 3.11
                "--seed", os.environ.get("ST_SEED", "11"),
                "--request-timeout", "20",
                "--no-color",
                *selection,
            ]  # fmt: skip
            if subprocess.run(command, cwd=ROOT, env=env).returncode != 0:
                failed.append(name)
        print(
            f"\nschemathesis: {len(phases) - len(failed)} passed, {len(failed)} failed"
            + (f" ({', '.join(failed)})" if failed else "")
        )
        return 1 if failed else 0
    finally:
        if proxy is not None:
            proxy.__exit__(None, None, None)
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
