"""``manage.py demo``: the whole control plane, this machine and a simulated fleet, and a story.

See docs/demo.md. ``--once`` runs the story and exits 0 only if every step passed.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from nodepool import instances
from nodepool.demo import stop

CHILD_FLAG = "NODEPOOL_DEMO_VAR_READY"
LOCK_FD = "NODEPOOL_DEMO_LOCK_FD"  # the var dir lock's file descriptor, kept across execve


class Command(BaseCommand):
    help = "Run the demo: web, worker, beat, this machine's agent, a simulated fleet and a checked story."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="run the story, print the summary, stop, exit 0/1")
        parser.add_argument("--nodes", type=int, default=None, help="simulated nodes (default 300, --once 120)")
        parser.add_argument("--port", type=int, default=None, help="web port (default 8000, --once a free one)")
        parser.add_argument("--seed", type=int, default=1)
        parser.add_argument("--var-dir", default=None, help="default var/demo (var/demo-once with --once)")
        parser.add_argument("--keep", action="store_true", help="do not wipe the var dir first")
        parser.add_argument("--timeout", type=float, default=120.0, help="longest wait of a step, seconds")
        parser.add_argument("--web-workers", type=int, default=2)
        parser.add_argument("--no-agent", action="store_true", help="do not enroll this machine")
        parser.add_argument("--no-progress", action="store_true")

    def handle(self, *args, **opts):
        var_dir = Path(opts["var_dir"] or ("var/demo-once" if opts["once"] else "var/demo"))
        if not var_dir.is_absolute():
            var_dir = Path(settings.BASE_DIR) / var_dir
        if os.environ.get(CHILD_FLAG) != str(var_dir):
            self._reexec(var_dir, keep=opts["keep"], port=opts["port"] or (None if opts["once"] else 8000))
        # From here on SIGTERM (CI, a supervisor) stops the demo as Ctrl-C does, in every phase.
        stop.install()
        lock = instances.adopt(os.environ.get(LOCK_FD), var_dir)
        try:
            self._run(var_dir, lock, opts)
        except KeyboardInterrupt:
            stop.interrupt_taken()
            # Before Demo.run (migrations, static files, users): no process was started yet.
            self.stderr.write("interrupted before the demo started; nothing is left running")
            raise SystemExit(130) from None

    def _run(self, var_dir: Path, lock, opts) -> None:
        # Lazy: listing manage.py's commands must not load the demo's runner (the simulator, processes).
        from nodepool.demo.runner import Demo

        nodes = opts["nodes"] if opts["nodes"] is not None else (120 if opts["once"] else 300)
        if nodes < 20:
            raise CommandError("--nodes must be at least 20 (the story disturbs a handful of them)")
        self.stdout.write(f"demo: migrating its database in {var_dir}…")
        call_command("migrate", verbosity=0, interactive=False)
        # The web server (whitenoise) serves the admin's and the API docs' files from STATIC_ROOT,
        # here the demo's own var dir: without them the admin is unstyled and /api/docs/ blank.
        # Symlinks, not copies: the demo's var dir is wiped at each start.
        call_command("collectstatic", verbosity=0, interactive=False, link=True)
        demo = Demo(
            var_dir=var_dir,
            nodes=nodes,
            port=opts["port"],
            once=opts["once"],
            seed=opts["seed"],
            timeout=opts["timeout"],
            web_workers=opts["web_workers"],
            agent=not opts["no_agent"],
            progress=not opts["no_progress"],
            out=self.stdout,
            instance_id=lock.info.get("id") if lock else None,
        )
        if lock is not None:
            lock.update(port=demo.port, url=demo.base_url)
        connections.close_all()  # the subprocesses own the database from here on
        ok = demo.run()
        # Non-zero unless the story completed and passed: 130 when interrupted before that.
        if not ok:
            raise SystemExit(130 if demo.interrupted else 1)

    def _reexec(self, var_dir: Path, *, keep: bool, port: int | None) -> None:
        """Settings are read at import: run again with NODEPOOL_VAR_DIR set to the demo's own dir.

        First the var dir's lock (nodepool.instances): a second demo on the same var dir or port is
        refused, naming the running one, before anything is deleted. The lock is kept across the
        ``execve`` (same process, same open file) and held until the demo exits.
        """
        try:
            lock = instances.acquire(var_dir, kind="make demo", port=port)
        except instances.AlreadyRunning as exc:
            raise CommandError(exc.message) from None
        if not keep:
            for entry in var_dir.iterdir():  # everything but the lock we hold
                if entry.name == instances.LOCK_NAME:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        env = dict(os.environ, NODEPOOL_VAR_DIR=str(var_dir), **{CHILD_FLAG: str(var_dir)})
        env[LOCK_FD] = lock.keep_across_exec()
        if "DATABASE_URL" in env:
            self.stderr.write(f"note: DATABASE_URL is set; the demo uses it as it is ({socket.gethostname()})")
        sys.stdout.flush()
        argv = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py"), *sys.argv[1:]]
        os.execve(sys.executable, argv, env)  # noqa: S606 (our own interpreter and arguments)
