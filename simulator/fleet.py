"""The fleet: many :class:`VirtualNode` sharing one ``httpx.AsyncClient`` and one event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import signal
import threading
from collections import Counter
from collections.abc import Iterable

import httpx
from tqdm import tqdm

from agent.client import USER_AGENT, api_base

from .node import VirtualNode
from .shapes import PoolSpec, generate
from .wire import Unavailable

DEFAULT_ZONES = ["zone-a", "zone-b", "zone-c"]


class FleetSimulator:
    """N virtual nodes against one control plane.

    Args:
        url: the control plane (``/api/v1`` appended if missing).
        pools: where nodes enroll; each pool's bootstrap token decides the pool on the server.
        seed: the same seed gives the same shapes, zones, pools, GPUs and jitter.
        zones: zone labels to spread nodes over.
        concurrency: enrollments in flight at once.
        transport: an httpx transport (tests pass ``httpx.MockTransport``).
        progress: show a tqdm bar while enrolling.
    """

    def __init__(
        self,
        url: str,
        *,
        pools: list[PoolSpec],
        seed: int = 1,
        zones: list[str] | None = None,
        concurrency: int = 32,
        transport: httpx.AsyncBaseTransport | None = None,
        progress: bool = True,
        timeout: float = 10.0,
        max_connections: int = 100,
        max_backoff: float = 60.0,
        enroll_attempts: int = 5,
        renewals: bool = True,
    ):
        self.url = api_base(url)
        self.pools = pools
        self.seed = seed
        self.zones = zones or DEFAULT_ZONES
        self.concurrency = concurrency
        self.transport = transport
        self.progress = progress
        self.timeout = timeout
        self.max_connections = max_connections
        self.max_backoff = max_backoff
        self.enroll_attempts = enroll_attempts
        self.renewals = renewals  # False: every beat is a full status report (the pre-renewal protocol)
        self.rng = random.Random(f"{seed}:faults")
        self.nodes: dict[str, VirtualNode] = {}
        self.client: httpx.AsyncClient | None = None
        self._loops: dict[str, asyncio.Task] = {}
        self._gate: asyncio.Semaphore | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = httpx.AsyncClient(
                base_url=self.url,
                timeout=self.timeout,
                transport=self.transport,
                limits=httpx.Limits(max_connections=self.max_connections),
                headers={"User-Agent": USER_AGENT + " (simulator)", "Accept": "application/json"},
            )
        return self.client

    def gate(self) -> asyncio.Semaphore:
        """Requests in flight at once, fewer than the pool's connections (see ``VirtualNode._post``)."""
        if self._gate is None:
            self._gate = asyncio.Semaphore(max(1, self.max_connections - 4))
        return self._gate

    def add_nodes(self, count: int) -> list[VirtualNode]:
        """Create ``count`` more virtual nodes (not enrolled yet) from the seed."""
        specs = generate(count, seed=self.seed, pools=self.pools, zones=self.zones, start=len(self.nodes))
        added = []
        for spec in specs:
            node = VirtualNode(
                spec, rng=random.Random(f"{self.seed}:{spec.name}"), max_backoff=self.max_backoff, gate=self.gate()
            )
            node.renewals_supported = self.renewals
            self.nodes[spec.name] = node
            added.append(node)
        return added

    async def enroll(self, count: int | None = None, *, impossible: Iterable[str] = ()) -> list[str]:
        """Enroll ``count`` new nodes (or every node not enrolled yet). Returns the enrolled names.

        ``impossible`` names nodes (of those created by this call, by name or index) that declare
        absurd capacity. Refused enrollments are kept with ``enroll_error`` set.
        """
        if count is not None:
            self.add_nodes(count)
        for name in impossible:
            self.node(name).impossible = True
        pending = [n for n in self.nodes.values() if not n.enrolled]
        client = self._client()
        semaphore = asyncio.Semaphore(self.concurrency)
        bar = tqdm(total=len(pending), desc="enrolling", unit="node", disable=not self.progress, leave=True)

        async def one(node: VirtualNode) -> None:
            async with semaphore:
                for attempt in range(self.enroll_attempts):
                    try:
                        await node.enroll(client)
                        break
                    except Unavailable as exc:
                        node.enroll_error = str(exc)
                        if attempt + 1 < self.enroll_attempts:
                            await asyncio.sleep(node.backoff.next_delay())
                node.backoff.reset()
            bar.update(1)

        try:
            await asyncio.gather(*(one(n) for n in pending))
        finally:
            bar.close()
        return [n.name for n in pending if n.enrolled]

    async def start(self) -> None:
        """Start the heartbeat loop of every enrolled node, staggered over one interval."""
        client = self._client()
        for node in self.nodes.values():
            if node.enrolled and node.name not in self._loops:
                self._loops[node.name] = asyncio.get_running_loop().create_task(self._run(node, client))

    async def _run(self, node: VirtualNode, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(node.rng.uniform(0, node.interval))  # spread the fleet's first beats
        while node.lifecycle != "retired":
            delay = await node.beat(client)
            await asyncio.sleep(delay)

    async def beat_all(self) -> None:
        """One heartbeat from every enrolled node now (the demo and tests step the fleet this way)."""
        client = self._client()
        await asyncio.gather(*(n.beat(client) for n in self.nodes.values() if n.enrolled))

    async def stop(self) -> None:
        """Stop every heartbeat loop and background task, and close the HTTP client."""
        loops = list(self._loops.values())
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        self._loops.clear()
        for node in self.nodes.values():
            await node.cancel_tasks()
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    # -- faults (plain setters: safe to call between awaits) ----------------------------------
    def node(self, name_or_index: str | int) -> VirtualNode:
        if isinstance(name_or_index, int):
            return list(self.nodes.values())[name_or_index]
        try:
            return self.nodes[name_or_index]
        except KeyError:
            raise KeyError(f"no simulated node named {name_or_index!r}") from None

    def pick(self, count: int, *, exclude: Iterable[str] = (), enrolled: bool = True) -> list[str]:
        """``count`` node names drawn from the seed (distinct, skipping ``exclude``)."""
        skip = set(exclude)
        names = sorted(n.name for n in self.nodes.values() if n.name not in skip and (n.enrolled or not enrolled))
        return self.rng.sample(names, min(count, len(names)))

    def partition(self, name: str) -> None:
        """Silence: the node sends nothing until :meth:`heal`."""
        self.node(name).partitioned = True

    def heal(self, name: str) -> None:
        self.node(name).partitioned = False

    def restart(self, name: str) -> None:
        """Restart the node's agent: incarnation + 1, sequence from 0, its running work lost."""
        self.node(name).restart()

    def skew_clock(self, name: str, seconds: float) -> None:
        """The node's clock runs ``seconds`` ahead (negative: behind) in ``observed_at``."""
        self.node(name).clock_skew = float(seconds)

    def duplicate_heartbeats(self, name: str, count: int = 1) -> None:
        """The next ``count`` heartbeats are each sent twice with the same sequence."""
        self.node(name).duplicate_next += count

    def reorder_heartbeats(self, name: str, count: int = 1) -> None:
        """The next ``count`` pairs of heartbeats arrive out of order (n+1 before n)."""
        self.node(name).reorder_next += count

    def underperform(self, name: str, factor: float = 0.4) -> None:
        """Benchmarks answer ``factor`` × the declared capacity: declared but not confirmed."""
        self.node(name).benchmark_factor = float(factor)

    def break_upgrades(self, name: str, broken: bool = True) -> None:
        """The node's next upgrades restart it without changing its version (admission refuses them)."""
        self.node(name).broken_upgrade = broken

    def inject_xid(self, name: str, device: int | str, xid: int, message: str = "") -> str:
        """GPU ``device`` (index or id) of node ``name`` reports Xid ``xid``; returns the device id."""
        return self.node(name).inject_xid(device, xid, message)

    def set_device_health(self, name: str, device: int | str, **flags) -> str:
        """Change a GPU's health flags (``ecc_uncorrectable=2``, ``thermal_throttle=True`` ...)."""
        return self.node(name).set_device_health(device, **flags)

    def reboot(self, name: str) -> None:
        """The host reboots: a new boot id, a new incarnation, its devices healthy again."""
        self.node(name).reboot()

    def not_ready(self, name: str, *, reboot_cures: bool = True) -> None:
        """The node reports Ready=False from now on; a repair reboot cures it unless ``reboot_cures`` is off."""
        node = self.node(name)
        node.not_ready, node.reboot_cures = True, reboot_cures

    def gpu_nodes(self) -> list[str]:
        """Names of the nodes that have devices."""
        return sorted(n.name for n in self.nodes.values() if n.devices)

    async def preempt(self, name: str, seconds: float) -> int:
        """Inject a spot preemption notice: the node says it goes away in ``seconds``."""
        return await self.node(name).preemption_notice(self._client(), seconds)

    # -- reading -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts across the fleet: nodes, enrollment, lifecycles seen, verdicts, faults, leases."""
        counters: Counter = Counter()
        lifecycles: Counter = Counter()
        for node in self.nodes.values():
            counters.update(node.counters)
            lifecycles[node.lifecycle or "unknown"] += 1
        return {
            "nodes": len(self.nodes),
            "enrolled": sum(n.enrolled for n in self.nodes.values()),
            "enroll_failed": sum(bool(n.enroll_error) and not n.enrolled for n in self.nodes.values()),
            "running_leases": sum(len(n.leases) for n in self.nodes.values()),
            "devices": sum(len(n.devices) for n in self.nodes.values()),
            "partitioned": sorted(n.name for n in self.nodes.values() if n.partitioned),
            "lifecycles": dict(lifecycles),
            "counters": dict(sorted(counters.items())),
        }


class FleetThread:
    """Drive a :class:`FleetSimulator` from synchronous code (a Django management command).

    The simulator's event loop runs in a daemon thread; every method blocks until the loop
    has done it. Use as a context manager, or call :meth:`open` and :meth:`close`.
    """

    def __init__(self, sim: FleetSimulator):
        self.sim = sim
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fleet-simulator", daemon=True)

    def open(self) -> FleetThread:
        self.thread.start()
        return self

    def __enter__(self) -> FleetThread:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _call(self, fn, *args):
        async def call():
            return fn(*args)

        return self._run(call())

    def enroll(self, count: int | None = None, *, impossible: Iterable[str] = ()) -> list[str]:
        return self._run(self.sim.enroll(count, impossible=list(impossible)))

    def add_nodes(self, count: int) -> list[str]:
        return [n.name for n in self._call(self.sim.add_nodes, count)]

    def start(self) -> None:
        self._run(self.sim.start())

    def beat_all(self) -> None:
        self._run(self.sim.beat_all())

    def partition(self, name: str) -> None:
        self._call(self.sim.partition, name)

    def heal(self, name: str) -> None:
        self._call(self.sim.heal, name)

    def restart(self, name: str) -> None:
        self._call(self.sim.restart, name)

    def skew_clock(self, name: str, seconds: float) -> None:
        self._call(self.sim.skew_clock, name, seconds)

    def duplicate_heartbeats(self, name: str, count: int = 1) -> None:
        self._call(self.sim.duplicate_heartbeats, name, count)

    def reorder_heartbeats(self, name: str, count: int = 1) -> None:
        self._call(self.sim.reorder_heartbeats, name, count)

    def underperform(self, name: str, factor: float = 0.4) -> None:
        self._call(self.sim.underperform, name, factor)

    def break_upgrades(self, name: str, broken: bool = True) -> None:
        self._call(self.sim.break_upgrades, name, broken)

    def not_ready(self, name: str, *, reboot_cures: bool = True) -> None:
        self._call(lambda: self.sim.not_ready(name, reboot_cures=reboot_cures))

    def inject_xid(self, name: str, device: int | str, xid: int, message: str = "") -> str:
        return self._call(self.sim.inject_xid, name, device, xid, message)

    def set_device_health(self, name: str, device: int | str, **flags) -> str:
        return self._call(lambda: self.sim.set_device_health(name, device, **flags))

    def reboot(self, name: str) -> None:
        self._call(self.sim.reboot, name)

    def preempt(self, name: str, seconds: float) -> int:
        return self._run(self.sim.preempt(name, seconds))

    def node(self, name: str) -> dict:
        return self._call(lambda: self.sim.node(name).summary())

    def stats(self) -> dict:
        return self._call(self.sim.stats)

    def close(self) -> None:
        """Stop the fleet and the loop thread."""
        if self.thread.is_alive():
            self._run(self.sim.stop(), timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        self.loop.close()


def run_coroutine(coro):
    """``asyncio.run(coro)``, also from a thread whose event loop is already running (a notebook,
    an embedding application, a test session that drives a browser): then in a thread of its own.
    Returns what the coroutine returns; raises what it raises."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="simulator") as executor:
        return executor.submit(asyncio.run, coro).result()


def stop_on_signals(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGINT or SIGTERM, from inside the running loop.

    Signals reach only the main thread: when :func:`run_coroutine` had to run the coroutine in a
    thread of its own (the caller's loop was busy), Ctrl-C stays the caller's to handle, and this
    installs nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
