"""The demo's run: processes up, environment, this machine, the fleet, the story, the summary."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from nodepool import instances
from simulator import FleetSimulator, FleetThread, PoolSpec

from . import processes, report, setup, stop
from .client import Api, TimedOut, poll
from .operations_story import stop_extra
from .processes import Supervisor
from .story import Story


@contextlib.contextmanager
def stop_signals_ignored():
    """Ignore SIGINT and SIGTERM for the block (main thread only; elsewhere nothing changes).

    Stopping takes a few seconds (the fleet, then web, worker, beat and agent, each with a bounded
    wait and SIGKILL after it): a second Ctrl-C, or a SIGTERM sent both to the demo and to its
    process group, must not cut that short and leave the children running.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)


class Demo:
    def __init__(self, *, var_dir: Path, nodes: int, port: int | None, once: bool, seed: int, timeout: float,
                 web_workers: int, agent: bool, progress: bool, out, instance_id: str | None = None):  # fmt: skip
        self.var_dir = var_dir
        self.nodes = nodes
        self.once = once
        self.seed = seed
        self.timeout = timeout
        self.web_workers = web_workers
        self.agent = agent
        self.progress = progress
        self.out = out
        self.interrupted = False  # a stop signal arrived before the story completed
        # Every process the demo starts, and everything those start (the simulated provider's
        # machines, in sessions of their own), carries this marker: the stop finds them all.
        self.instance_id = instance_id or uuid.uuid4().hex
        if port is None:
            port = processes.free_port() if once else 8000
        if processes.port_in_use(port):
            raise SystemExit(f"port {port} is in use: pass --port")
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.hostname = socket.gethostname()
        env = {k: v for k, v in os.environ.items() if not k.startswith("NODEPOOL_DEMO")}
        # One Prometheus multiprocess directory for the demo's web and worker processes, emptied
        # at each start, so /metrics sums their counters (nodepool.metrics).
        metrics_dir = var_dir / "prometheus"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True, exist_ok=True)
        env.update(NODEPOOL_VAR_DIR=str(var_dir), PYTHONUNBUFFERED="1", PROMETHEUS_MULTIPROC_DIR=str(metrics_dir))
        env[instances.MARKER] = self.instance_id
        # Pool operations at the story's pace: upgrade ticks every second, autoscaling every 3 s,
        # simulator machines that find this web server and stop by themselves within the hour.
        env.setdefault("NODEPOOL_UPGRADE_TICK", "1")
        env.setdefault("NODEPOOL_AUTOSCALE_INTERVAL", "3")
        env.setdefault("NODEPOOL_SIMULATED_PROVIDER_URL", self.base_url)
        env.setdefault("NODEPOOL_SIMULATED_MACHINE_LIFETIME", "3600")
        self.supervisor = Supervisor(var_dir / "logs", env)
        self.operator = setup.create_users()
        # One line per request from httpx (the fleet sends dozens a second) would bury the story.
        logging.getLogger("httpx").setLevel(logging.WARNING)

    def say(self, line: str = "") -> None:
        self.out.write(line)
        self.out.flush()

    def run(self) -> bool:
        fleet = story = None
        api = Api(self.base_url, self.operator.token)
        ok = completed = False
        try:
            self.start_processes(api)
            pools = setup.create_pools(api)
            tokens = setup.create_tokens(api, max_uses=self.nodes + 20)
            self.say(f"pools: {', '.join(pools)}; bootstrap tokens made (general: {tokens['general'][:16]}…)")
            setup.create_prices(api)
            op = self.operator
            self.say(f"operator: {op.username} / {op.password}   API token: {op.token}")
            self.say(f"owner:    {op.owner_username} / {op.owner_password}   (the contributor's view, same admin)")
            if self.agent:
                state = self.var_dir / "agent" / "state.json"
                command = processes.agent_command(self.base_url, tokens["general"], state, self.hostname)
                self.supervisor.start("agent", command)
                self.say(f"agent: enrolling this machine ({self.hostname}), state in {state}")
            fleet, bad = self.start_fleet(tokens)
            admitted = self.wait_for_admission(api)
            story = Story(api, fleet, bad=bad, this_machine=self.hostname, timeout=self.timeout, say=self.say)
            steps = story.all() if self.agent else story.all()[1:]
            results = story.run(steps)
            dead = self.supervisor.dead()
            for name, status in dead.items():
                self.say(f"process {name} exited ({status}):\n{self.supervisor.tail(name)}")
            login = (self.operator.username, self.operator.password)
            owner = (self.operator.owner_username, self.operator.owner_password)
            self.say(
                report.summary(
                    api, results, base_url=self.base_url, login=login, token=self.operator.token, owner=owner
                )
            )
            self.say(f"logs: {self.supervisor.log_dir}")
            ok = admitted and all(r.ok for r in results) and not dead
            completed = True
            if not self.once:
                self.say("\nThe demo keeps running (the fleet heartbeats, beat sweeps). Ctrl-C stops everything.")
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            stop.interrupt_taken()
            self.interrupted = not completed
            self.say("\nstopping…" if completed else "\ninterrupted before the story completed; stopping…")
        finally:
            with stop_signals_ignored():
                if story is not None:
                    stop_extra(story)
                if fleet is not None:
                    fleet.close()
                api.close()
                stopped = self.supervisor.stop_all()
                # Whatever else carries the marker, in any process group (provider machines).
                stragglers = instances.stop_marked(self.instance_id, grace=processes.STOP_GRACE_SECONDS)
            self.say("stopped: " + ", ".join(f"{n} ({s})" for n, s in stopped.items()))
            if stragglers:
                self.say(f"stopped {len(stragglers)} more process(es) the demo had started: {stragglers}")
        return ok

    def start_processes(self, api: Api) -> None:
        self.say(f"var dir: {self.var_dir}")
        self.supervisor.start("web", processes.web_command(self.port, self.web_workers))
        self.supervisor.start("worker", processes.worker_command(2))
        # Beat starts once the worker is ready: on a fresh embedded broker, kombu's SQLAlchemy
        # transport creates the queue row with a check-then-insert, and a beat racing the worker
        # there can lose with "UNIQUE constraint failed: kombu_queue.name" and stop sending.
        worker_ready = lambda: " ready." in self.supervisor.tail("worker", 200)  # noqa: E731
        up = processes.wait_until(lambda: (api.ready() and worker_ready()) or self.supervisor.dead(), timeout=120)
        if up and not self.supervisor.dead():
            self.supervisor.start("beat", processes.beat_command(self.var_dir))
        if not up or self.supervisor.dead():
            for name in self.supervisor.dead() or ["web", "worker"]:
                self.say(f"{name} did not start:\n{self.supervisor.tail(name)}")
            raise SystemExit("the control plane did not start")
        self.say(f"web {self.base_url}, worker and beat started (logs in {self.supervisor.log_dir})")

    def start_fleet(self, tokens: dict[str, str]) -> tuple[FleetThread, dict[str, str]]:
        sim = FleetSimulator(
            self.base_url,
            pools=[
                PoolSpec("general", tokens["general"], weight=3),
                PoolSpec("gpu", tokens["gpu"], weight=1, gpu=True),
                PoolSpec("marketplace", tokens["marketplace"], weight=1),
            ],
            seed=self.seed,
            progress=self.progress,
            concurrency=8,
            max_backoff=10.0,
            # Requests in flight at once: the rest wait in the simulator, not in gunicorn's queue
            # where their 10 s timeout would run out on a loaded machine.
            max_connections=24,
        )
        fleet = FleetThread(sim).open()
        fleet.sim = sim
        names = fleet.add_nodes(self.nodes)
        in_pool = {pool: [n for n in names if sim.nodes[n].spec.pool == pool] for pool in ("general", "marketplace")}
        bad = {"underperform": in_pool["marketplace"][0], "impossible": in_pool["general"][0]}
        fleet.underperform(bad["underperform"], 0.3)
        self.say(
            f"simulated fleet: {self.nodes} nodes over zone-a/b/c; {bad['underperform']} (marketplace) will answer "
            f"its benchmark with 30 % of what it declares, {bad['impossible']} declares impossible capacity"
        )
        started = time.monotonic()
        enrolled = fleet.enroll(impossible=[bad["impossible"]])
        self.say(f"enrolled {len(enrolled)}/{self.nodes} in {time.monotonic() - started:.0f} s")
        sys.stderr.flush()
        fleet.start()
        return fleet, bad

    def wait_for_admission(self, api: Api) -> bool:
        """Until no node is pending or admitting (admission runs on the worker; benchmarks too)."""
        started = time.monotonic()

        def waiting():
            return sum(api.get("/nodes", lifecycle=state, page_size=1)["count"] for state in ("pending", "admitting"))

        try:
            limit = max(180.0, self.nodes * 1.0)
            poll(waiting, lambda n: n == 0, timeout=limit, what="admission to finish", interval=2)
        except TimedOut as exc:
            self.say(f"FAIL admission: {exc}")
            return False
        ready = api.get("/nodes", lifecycle="ready", page_size=1)["count"]
        self.say(f"admission done in {time.monotonic() - started:.0f} s: {ready} nodes ready")
        return True
