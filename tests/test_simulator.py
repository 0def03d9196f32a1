"""The fleet simulator: seeded shapes, enrollment, heartbeats and every fault, against a fake control plane."""

import asyncio
import functools
import json
import time
from datetime import UTC, datetime

import httpx
import pytest

from simulator import FleetSimulator, FleetThread, PoolSpec
from simulator import cli as simulator_cli
from simulator.shapes import generate
from tests.fake_control_plane import FakeControlPlane

TOKENS = {"npb_general.secret": "general", "npb_gpu.secret": "gpu"}
POOLS = [PoolSpec("general", "npb_general.secret", weight=3), PoolSpec("gpu", "npb_gpu.secret", weight=1, gpu=True)]


@pytest.fixture
def fake():
    return FakeControlPlane(tokens=TOKENS, heartbeat_interval=10.0)


def make_sim(fake, **kwargs):
    kwargs.setdefault("pools", POOLS)
    kwargs.setdefault("progress", False)
    return FleetSimulator("http://cp.test", transport=httpx.MockTransport(fake.handle), seed=1, **kwargs)


def run(coro):
    return asyncio.run(coro)


def test_the_same_seed_draws_the_same_fleet_and_another_seed_a_different_one():
    zones = ["a", "b", "c"]
    first = generate(50, seed=1, pools=POOLS, zones=zones)
    again = generate(50, seed=1, pools=POOLS, zones=zones)
    other = generate(50, seed=2, pools=POOLS, zones=zones)

    assert first == again
    assert [s.shape for s in first] != [s.shape for s in other]
    assert generate(10, seed=1, pools=POOLS, zones=zones, start=40) == first[40:]
    assert {s.zone for s in first} == set(zones)
    assert all(s.gpu_count > 0 for s in first if s.pool == "gpu")
    assert all(s.gpu_count == 0 for s in first if s.pool == "general")
    assert {s.pool for s in first} == {"general", "gpu"}


def test_enrollment_creates_every_node_in_the_pool_of_its_bootstrap_token(fake):
    async def scenario():
        sim = make_sim(fake)
        names = await sim.enroll(40)
        await sim.stop()
        return sim, names

    sim, names = run(scenario())

    assert len(names) == 40 and len(fake.nodes) == 40
    for name in names:
        node, spec = fake.node_by_hostname(name), sim.node(name).spec
        assert node.pool == spec.pool
        assert node.enrollment["labels"]["zone"] == spec.zone
        assert node.enrollment["capability"]["resources"]["cpu"] == str(spec.cpu)
        if spec.gpu_count:
            assert node.enrollment["capability"]["accelerators"][0]["count"] == spec.gpu_count


def test_enrollment_shows_a_progress_bar(fake, capsys):
    async def scenario():
        sim = make_sim(fake, progress=True)
        await sim.enroll(5)
        await sim.stop()

    run(scenario())
    assert "enrolling" in capsys.readouterr().err


def test_a_node_can_declare_impossible_capacity_at_enrollment(fake):
    async def scenario():
        sim = make_sim(fake)
        sim.add_nodes(3)
        await sim.enroll(impossible=["sim-1-0001"])
        await sim.stop()

    run(scenario())
    declared = fake.node_by_hostname("sim-1-0001").enrollment["capability"]["resources"]
    assert declared["cpu"] == "100000" and declared["memory"] == "1Pi"
    assert fake.node_by_hostname("sim-1-0000").enrollment["capability"]["resources"]["cpu"] != "100000"


def _beats(fake, name):
    return fake.node_by_hostname(name).heartbeats


def _verdicts(fake, name):
    return fake.node_by_hostname(name).verdicts


def test_a_partitioned_node_falls_silent_until_healed(fake):
    async def scenario():
        sim = make_sim(fake)
        await sim.enroll(3)
        await sim.beat_all()
        sim.partition("sim-1-0001")
        await sim.beat_all()
        await sim.beat_all()
        silent = len(_beats(fake, "sim-1-0001"))
        sim.heal("sim-1-0001")
        await sim.beat_all()
        await sim.stop()
        return silent

    assert run(scenario()) == 1
    assert len(_beats(fake, "sim-1-0001")) == 2
    assert len(_beats(fake, "sim-1-0000")) == 4


def test_a_restart_bumps_the_incarnation_and_starts_the_sequence_again(fake):
    async def scenario():
        sim = make_sim(fake)
        await sim.enroll(1)
        await sim.beat_all()
        await sim.beat_all()
        sim.restart("sim-1-0000")
        await sim.beat_all()
        await sim.stop()

    run(scenario())
    assert [(b["incarnation"], b["sequence"]) for b in _beats(fake, "sim-1-0000")] == [(1, 1), (1, 2), (2, 1)]
    assert _verdicts(fake, "sim-1-0000") == ["applied"] * 3


def test_clock_skew_moves_the_observed_time(fake):
    async def scenario():
        sim = make_sim(fake)
        await sim.enroll(1)
        sim.skew_clock("sim-1-0000", 3600)
        await sim.beat_all()
        await sim.stop()

    before = time.time()
    run(scenario())
    observed = datetime.fromisoformat(_beats(fake, "sim-1-0000")[0]["observed_at"].replace("Z", "+00:00"))
    assert observed.timestamp() - before >= 3590
    assert observed.tzinfo == UTC


def test_a_duplicated_heartbeat_is_sent_twice_with_the_same_sequence(fake):
    async def scenario():
        sim = make_sim(fake)
        await sim.enroll(1)
        sim.duplicate_heartbeats("sim-1-0000")
        await sim.beat_all()
        await sim.beat_all()
        await sim.stop()

    run(scenario())
    assert [b["sequence"] for b in _beats(fake, "sim-1-0000")] == [1, 1, 2]
    assert _verdicts(fake, "sim-1-0000") == ["applied", "duplicate_sequence", "applied"]


def test_reordered_heartbeats_arrive_later_first(fake):
    async def scenario():
        sim = make_sim(fake)
        await sim.enroll(1)
        await sim.beat_all()
        sim.reorder_heartbeats("sim-1-0000")
        await sim.beat_all()
        await sim.stop()

    run(scenario())
    assert [b["sequence"] for b in _beats(fake, "sim-1-0000")] == [1, 3, 2]
    assert _verdicts(fake, "sim-1-0000") == ["applied", "applied", "stale_sequence"]


def test_an_underperforming_node_answers_its_benchmark_with_low_figures(fake):
    async def scenario():
        sim = make_sim(fake)
        await sim.enroll(2)
        sim.underperform("sim-1-0001", 0.4)
        nonces = {name: fake.request_benchmark(sim.node(name).node_id) for name in ("sim-1-0000", "sim-1-0001")}
        await sim.beat_all()
        for _ in range(100):
            if all(fake.benchmarks[n]["result"] for n in nonces.values()):
                break
            await asyncio.sleep(0.05)
        await sim.stop()
        return sim, nonces

    sim, nonces = run(scenario())
    honest, liar = (fake.benchmarks[nonces[n]]["result"] for n in ("sim-1-0000", "sim-1-0001"))
    assert honest["cpu_millicores"] >= 0.95 * sim.node("sim-1-0000").spec.cpu * 1000
    assert liar["cpu_millicores"] <= 0.4 * sim.node("sim-1-0001").spec.cpu * 1000
    assert liar["memory_bytes"] <= 0.4 * sim.node("sim-1-0001").spec.memory


def test_leases_are_run_reported_and_stopped_virtually(fake):
    async def scenario():
        sim = make_sim(fake)
        await sim.enroll(1)
        node_id = sim.node(0).node_id
        short = fake.grant_lease(node_id, ["sleep", "0.05"])
        long = fake.grant_lease(node_id, ["serve", "--forever"])
        await sim.beat_all()
        await asyncio.sleep(0.2)
        await sim.beat_all()
        reported = _beats(fake, "sim-1-0000")[-1]["leases"]
        fake.nodes[node_id].stop_leases = [long.id]
        await sim.beat_all()
        await sim.stop()
        return short, long, reported

    short, long, reported = run(scenario())
    assert [e["state"] for e in short.events] == ["running", "succeeded"]
    assert reported == [{"lease_id": long.id, "fencing_token": long.fencing_token, "state": "running"}]
    assert [e["state"] for e in long.events] == ["running", "failed"]


def test_nodes_back_off_while_the_server_is_away(fake):
    async def scenario():
        sim = make_sim(fake, max_backoff=30)
        await sim.enroll(1)
        fake.down = True
        node, client = sim.node(0), sim._client()
        delays = [await node.beat(client) for _ in range(8)]
        await sim.stop()
        return delays

    delays = run(scenario())
    assert delays[0] <= 1 and 15 <= delays[-1] <= 30


def test_a_fleet_thread_runs_heartbeats_in_the_background_and_takes_faults_by_name(fake):
    fake.heartbeat_interval = 0.02
    sim = make_sim(fake)
    with FleetThread(sim) as fleet:
        names = fleet.enroll(5)
        fleet.start()
        deadline = time.monotonic() + 10
        while min(len(_beats(fake, n)) for n in names) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        fleet.partition(names[0])
        silenced_at = len(_beats(fake, names[0]))
        while len(_beats(fake, names[1])) < silenced_at + 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = fleet.stats()
        summary = fleet.node(names[0])

    assert len(_beats(fake, names[0])) <= silenced_at + 1  # at most one beat already in flight
    assert stats["enrolled"] == 5 and stats["partitioned"] == [names[0]]
    assert stats["counters"]["verdict_applied"] >= 15
    assert summary["faults"] == {"partitioned": True}


def test_the_command_line_runs_a_fleet_with_faults_and_prints_a_summary(fake, monkeypatch, capsys):
    fake.heartbeat_interval = 0.05
    monkeypatch.setattr(
        simulator_cli, "FleetSimulator", functools.partial(FleetSimulator, transport=httpx.MockTransport(fake.handle))
    )
    code = simulator_cli.main(
        [
            "--url",
            "http://cp.test",
            "--pool",
            "name=general,token=npb_general.secret,weight=2",
            "--pool",
            "name=gpu,token=npb_gpu.secret,gpu=true",
            "--nodes",
            "12",
            "--duration",
            "1.5",
            "--fault-after",
            "0.1",
            "--partition",
            "2",
            "--restart",
            "1",
            "--duplicate",
            "1",
            "--reorder",
            "1",
            "--impossible",
            "1",
            "--underperform",
            "1",
            "--no-progress",
        ]
    )

    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert summary["enrolled"] == 12
    assert len(summary["faults"]["partition"]) == 2 and len(summary["faults"]["impossible"]) == 1
    assert summary["counters"]["restarts"] == 1
    assert summary["counters"]["verdict_duplicate_sequence"] >= 1
    assert summary["counters"]["verdict_stale_sequence"] >= 1
    impossible = fake.node_by_hostname(summary["faults"]["impossible"][0])
    assert impossible.enrollment["capability"]["resources"]["cpu"] == "100000"


def test_a_pool_argument_without_a_token_is_refused():
    with pytest.raises(SystemExit):
        simulator_cli.build_parser().parse_args(["--url", "http://x", "--pool", "name=general"])
