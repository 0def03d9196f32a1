"""The fleet simulator against the real control plane (in process): seeded shapes, enrollment,
heartbeats and every fault, with the app's own verdicts and the database's state checked."""

import asyncio
import functools
import json
import os
import signal
import threading
import time
from datetime import UTC, datetime

import httpx
import pytest

from fleet.models import Benchmark, Node
from leases.models import Lease
from simulator import FleetSimulator, FleetThread, PoolSpec
from simulator import cli as simulator_cli
from simulator.shapes import generate
from tests.control_plane import ControlPlane

POOLS = [PoolSpec("general", "", weight=3), PoolSpec("gpu", "", weight=1, gpu=True)]


# The simulator's loop runs in its own thread (FleetThread) and the app in another: committed data.
transactional = pytest.mark.django_db(transaction=True)
# Beats back to back: the flood guard has its own tests (tests/fleet/test_renewals_flood.py).
pytestmark = pytest.mark.usefixtures("no_flood_guard")


@pytest.fixture
def cp(transactional_db):
    plane = ControlPlane({"general": {}, "gpu": {}}, heartbeat_interval=10)
    yield plane
    plane.close()


def make_sim(cp, **kwargs):
    # The pre-renewal protocol (a full heartbeat every beat) for the fault tests, which count
    # heartbeats; renewals have their own test below.
    kwargs.setdefault("renewals", False)
    kwargs.setdefault(
        "pools",
        [PoolSpec("general", cp.tokens["general"], weight=3), PoolSpec("gpu", cp.tokens["gpu"], weight=1, gpu=True)],
    )
    return cp.make_simulator(**kwargs)


@pytest.fixture
def fleet(cp):
    with FleetThread(make_sim(cp)) as thread:
        yield thread


def _enrollment(cp, hostname):
    enrollments = [e for e in cp.exchanges if e.path == "/api/v1/node-enrollments"]
    (exchange,) = [e for e in enrollments if e.request["hostname"] == hostname]
    assert exchange.status == 201, exchange.body
    return exchange.request


def _beats(cp, name):
    return cp.heartbeats(cp.node_by_hostname(name).pk)


def _verdicts(cp, name):
    return cp.verdicts(cp.node_by_hostname(name).pk)


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


def test_enrollment_creates_every_node_in_the_pool_of_its_bootstrap_token(cp, fleet):
    names = fleet.enroll(40)
    sim = fleet.sim

    assert len(names) == 40 and Node.objects.count() == 40
    for name in names:
        node, spec, sent = cp.node_by_hostname(name), sim.node(name).spec, _enrollment(cp, name)
        assert node.pool.name == spec.pool
        assert node.node_labels["zone"] == spec.zone == sent["labels"]["zone"]
        assert sent["capability"]["resources"]["cpu"] == str(spec.cpu)
        assert node.declared["resources"]["cpu"] == spec.cpu * 1000
        if spec.gpu_count:
            assert sent["capability"]["accelerators"][0]["count"] == spec.gpu_count


def test_enrollment_shows_a_progress_bar(cp, capsys):
    with FleetThread(make_sim(cp, progress=True)) as fleet:
        fleet.enroll(5)
    assert "enrolling" in capsys.readouterr().err
    assert Node.objects.count() == 5


def test_a_node_can_declare_impossible_capacity_at_enrollment(cp, fleet):
    fleet.add_nodes(3)
    fleet.enroll(impossible=["sim-1-0001"])
    declared = _enrollment(cp, "sim-1-0001")["capability"]["resources"]
    assert declared["cpu"] == "100000" and declared["memory"] == "1Pi"
    assert cp.node_by_hostname("sim-1-0001").declared["resources"]["cpu"] == 100000 * 1000
    assert _enrollment(cp, "sim-1-0000")["capability"]["resources"]["cpu"] != "100000"


def test_a_partitioned_node_falls_silent_until_healed(cp, fleet):
    fleet.enroll(3)
    fleet.beat_all()
    fleet.partition("sim-1-0001")
    fleet.beat_all()
    fleet.beat_all()
    assert len(_beats(cp, "sim-1-0001")) == 1
    fleet.heal("sim-1-0001")
    fleet.beat_all()

    assert len(_beats(cp, "sim-1-0001")) == 2
    assert len(_beats(cp, "sim-1-0000")) == 4
    assert cp.node_by_hostname("sim-1-0001").sequence == 2, "the partitioned node's sequences went unsent"


def test_a_restart_bumps_the_incarnation_and_starts_the_sequence_again(cp, fleet):
    fleet.enroll(1)
    fleet.beat_all()
    fleet.beat_all()
    fleet.restart("sim-1-0000")
    fleet.beat_all()

    assert [(b["incarnation"], b["sequence"]) for b in _beats(cp, "sim-1-0000")] == [(1, 1), (1, 2), (2, 1)]
    assert _verdicts(cp, "sim-1-0000") == ["applied"] * 3
    node = cp.node_by_hostname("sim-1-0000")
    assert (node.incarnation, node.sequence, node.restart_count) == (2, 1, 1)


def test_clock_skew_moves_the_observed_time(cp, fleet):
    before = time.time()
    fleet.enroll(1)
    fleet.skew_clock("sim-1-0000", 3600)
    fleet.beat_all()

    observed = datetime.fromisoformat(_beats(cp, "sim-1-0000")[0]["observed_at"].replace("Z", "+00:00"))
    assert observed.timestamp() - before >= 3590
    assert observed.tzinfo == UTC
    skew = next(c for c in cp.node_by_hostname("sim-1-0000").conditions if c["type"] == "ClockSkew")
    assert skew["status"] == "True", "the server measured the skew"


def test_a_duplicated_heartbeat_is_sent_twice_with_the_same_sequence(cp, fleet):
    fleet.enroll(1)
    fleet.duplicate_heartbeats("sim-1-0000")
    fleet.beat_all()
    fleet.beat_all()

    assert [b["sequence"] for b in _beats(cp, "sim-1-0000")] == [1, 1, 2]
    assert _verdicts(cp, "sim-1-0000") == ["applied", "duplicate_sequence", "applied"]


def test_reordered_heartbeats_arrive_later_first(cp, fleet):
    fleet.enroll(1)
    fleet.beat_all()
    fleet.reorder_heartbeats("sim-1-0000")
    fleet.beat_all()

    assert [b["sequence"] for b in _beats(cp, "sim-1-0000")] == [1, 3, 2]
    assert _verdicts(cp, "sim-1-0000") == ["applied", "applied", "stale_sequence"]
    assert cp.node_by_hostname("sim-1-0000").sequence == 3


@transactional
def test_an_underperforming_node_answers_its_benchmark_with_low_figures_and_is_rejected():
    cp = ControlPlane({"bench": {"benchmark_required": True, "benchmark_tolerance": 0.8}})
    sim = cp.make_simulator(pools=[PoolSpec("bench", cp.tokens["bench"])], renewals=False)
    with FleetThread(sim) as fleet:
        fleet.enroll(2)
        fleet.underperform("sim-1-0001", 0.4)
        for name in ("sim-1-0000", "sim-1-0001"):
            assert cp.admit(sim.node(name).node_id) == "admitting"
        fleet.beat_all()
        deadline = time.monotonic() + 20
        while Benchmark.objects.filter(status="requested").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    cp.close()

    honest, liar = (Benchmark.objects.get(node__hostname=n).result for n in ("sim-1-0000", "sim-1-0001"))
    assert honest["cpu_millicores"] >= 0.95 * sim.node("sim-1-0000").spec.cpu * 1000
    assert liar["cpu_millicores"] <= 0.4 * sim.node("sim-1-0001").spec.cpu * 1000
    assert liar["memory_bytes"] <= 0.4 * sim.node("sim-1-0001").spec.memory
    assert cp.node_by_hostname("sim-1-0000").lifecycle == "ready"
    assert cp.node_by_hostname("sim-1-0001").lifecycle == "rejected"


def test_leases_are_run_reported_and_stopped_virtually(cp):
    with FleetThread(make_sim(cp, pools=[PoolSpec("general", cp.tokens["general"])])) as fleet:
        fleet.enroll(1)
        fleet.beat_all()
        cp.admit(fleet.sim.node(0).node_id)
        short = cp.grant_lease(["sleep", "0.05"])
        long = cp.grant_lease(["serve", "--forever"])
        fleet.beat_all()
        time.sleep(0.2)
        fleet.beat_all()
        reported = _beats(cp, "sim-1-0000")[-1]["leases"]
        cp.revoke_lease(Lease.objects.get(pk=long.pk))
        fleet.beat_all()

    assert [e["state"] for e in cp.lease_events(short)] == ["running", "succeeded"]
    assert reported == [{"lease_id": str(long.pk), "fencing_token": long.fencing_token, "state": "running"}]
    assert [e["state"] for e in cp.lease_events(long)] == ["running", "failed"]
    assert Lease.objects.get(pk=short.pk).state == "released"
    assert Lease.objects.get(pk=long.pk).state == "revoked"


def test_nodes_back_off_while_the_server_is_away(cp):
    with FleetThread(make_sim(cp, max_backoff=30)) as fleet:
        fleet.enroll(1)
        cp.wire.down = True  # a transport fault the real app cannot produce
        node, client = fleet.sim.node(0), fleet._call(fleet.sim._client)
        delays = [fleet._run(node.beat(client)) for _ in range(8)]
        cp.wire.down = False

    assert delays[0] <= 1 and 15 <= delays[-1] <= 30


@transactional
def test_a_fleet_thread_runs_heartbeats_in_the_background_and_takes_faults_by_name():
    cp = ControlPlane(heartbeat_interval=1)
    sim = cp.make_simulator(renewals=False)
    with FleetThread(sim) as fleet:
        names = fleet.enroll(5)
        fleet.start()
        deadline = time.monotonic() + 20
        while min(len(_beats(cp, n)) for n in names) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        fleet.partition(names[0])
        silenced_at = len(_beats(cp, names[0]))
        while len(_beats(cp, names[1])) < silenced_at + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = fleet.stats()
        summary = fleet.node(names[0])
    cp.close()

    assert len(_beats(cp, names[0])) <= silenced_at + 1  # at most one beat already in flight
    assert stats["enrolled"] == 5 and stats["partitioned"] == [names[0]]
    assert stats["counters"]["verdict_applied"] >= 10
    assert summary["faults"] == {"partitioned": True}
    assert Node.objects.filter(sequence__gte=2).count() == 5


@transactional
@pytest.mark.parametrize("caller", ["plain", "inside a running event loop"])
def test_the_command_line_runs_a_fleet_with_faults_and_prints_a_summary(monkeypatch, capsys, caller):
    """Also from inside a running event loop (as pytest-playwright's sync API leaves one): the fleet
    then runs in a thread of its own, where signal handlers cannot be installed."""
    cp = ControlPlane({"general": {}, "gpu": {}}, heartbeat_interval=1)
    monkeypatch.setattr(
        simulator_cli, "FleetSimulator", functools.partial(FleetSimulator, transport=cp.async_transport())
    )
    argv = [
        "--url",
        cp.url,
        "--pool",
        f"name=general,token={cp.tokens['general']},weight=2",
        "--pool",
        f"name=gpu,token={cp.tokens['gpu']},gpu=true",
        "--nodes",
        "12",
        "--duration",
        "2.5",
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
    if caller == "plain":
        code = simulator_cli.main(argv)
    else:
        # In a fresh thread: this test's own thread may already hold a running loop (a browser test
        # ran before it in this worker), where asyncio.run itself refuses.
        async def busy_loop() -> int:
            return simulator_cli.main(argv)

        codes = []
        thread = threading.Thread(target=lambda: codes.append(asyncio.run(busy_loop())))
        thread.start()
        thread.join(60)
        code = codes[0] if codes else None

    cp.close()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0
    assert summary["enrolled"] == 12 and Node.objects.count() == 12
    assert len(summary["faults"]["partition"]) == 2 and len(summary["faults"]["impossible"]) == 1
    assert summary["counters"]["restarts"] == 1
    assert summary["counters"]["verdict_duplicate_sequence"] >= 1
    assert summary["counters"]["verdict_stale_sequence"] >= 1
    impossible = cp.node_by_hostname(summary["faults"]["impossible"][0])
    assert impossible.declared["resources"]["cpu"] == 100000 * 1000


def test_ctrl_c_while_enrolling_stops_cleanly_with_a_summary(monkeypatch, capsys):
    """SIGINT during enrollment (a large fleet takes a while) ends the run with its summary and
    exit code 130, not a KeyboardInterrupt traceback."""
    started = []

    async def slow_enroll(self, count=None, *, impossible=()):
        started.append(True)
        asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGINT)
        await asyncio.sleep(30)

    monkeypatch.setattr(FleetSimulator, "enroll", slow_enroll)
    code = simulator_cli.main(["--url", "http://127.0.0.1:9", "--pool", "name=general,token=t", "--no-progress"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert started and code == 130
    assert summary["interrupted"] == "enrolling" and summary["enrolled"] == 0


def test_a_pool_argument_without_a_token_is_refused():
    with pytest.raises(SystemExit):
        simulator_cli.build_parser().parse_args(["--url", "http://x", "--pool", "name=general"])


def test_virtual_nodes_renew_and_report_their_status_on_change_and_when_asked(cp):
    with FleetThread(make_sim(cp, pools=[PoolSpec("general", cp.tokens["general"])], renewals=True)) as fleet:
        fleet.enroll(1)
        fleet.beat_all()  # a status report first
        fleet.beat_all()
        fleet.beat_all()  # then renewals while nothing changes
        node = cp.node_by_hostname("sim-1-0000")
        cp.admit(node.pk)  # the lifecycle changed: the next renewal's flag asks for a report
        fleet.beat_all()
        fleet.beat_all()
        sent = [(e.endpoint, e.request["sequence"], e.status) for e in cp.exchanges if e.node_id == str(node.pk)]
    cp.close()
    assert [s for s in sent if s[0] == "heartbeats"][:2] == [("heartbeats", 1, 200), ("heartbeats", 5, 200)]
    assert [s for s in sent if s[0] == "renewals"][:3] == [
        ("renewals", 2, 200),
        ("renewals", 3, 200),
        ("renewals", 4, 200),
    ]
    assert cp.node_by_hostname("sim-1-0000").sequence >= 5


def test_the_command_lines_run_their_loop_even_where_one_is_already_running():
    """Playwright's sync API (the browser tests) leaves a loop running in the thread for the rest of
    the session, where asyncio.run() refuses: simulator.fleet.run_coroutine then uses a thread."""
    from simulator.fleet import run_coroutine

    async def answer():
        return 42

    async def from_inside_a_running_loop():
        return run_coroutine(answer())

    assert run_coroutine(answer()) == 42
    # The "inside" case runs in a fresh thread: this test's own thread may already hold a running
    # loop (a browser test ran before it in this worker), where asyncio.run itself refuses.
    inside = []
    thread = threading.Thread(target=lambda: inside.append(asyncio.run(from_inside_a_running_loop())))
    thread.start()
    thread.join(30)
    assert inside == [42]


@pytest.mark.parametrize("fault", ["none", "reorder", "duplicate"])
def test_a_restart_an_answer_starts_is_followed_by_a_status_report_not_a_renewal(fault):
    """The upgrade instruction in a status report's answer restarts the node (a new incarnation):
    its next beat is that incarnation's status report, not a renewal the server must refuse, even
    when a second body of the same beat (the reorder and duplicate faults) is answered after it."""
    from simulator.node import VirtualNode

    node = VirtualNode(generate(1, seed=1, pools=[PoolSpec("general", "t")], zones=["a"])[0])
    node.node_id, node.renewals_supported, node.last_report_at = "n1", True, time.monotonic()
    node.report_wanted = True
    node.reorder_next, node.duplicate_next = int(fault == "reorder"), int(fault == "duplicate")
    upgrade = {"applied": True, "instructions": {"upgrade": {"upgrade_id": "u1", "version": "2.0.0"}}}
    stale = {"applied": False, "code": "stale_sequence"}
    answers = [httpx.Response(200, json=upgrade), httpx.Response(200, json=stale)]
    sent = []

    async def post(client, path, body, **kwargs):
        sent.append(path)
        return answers.pop(0)

    node._post = post
    asyncio.run(node.beat(None))

    assert (node.agent_version, node.incarnation) == ("2.0.0", 1)
    assert sent == ["/nodes/n1/heartbeats"] * (1 if fault == "none" else 2)
    assert node.report_wanted and node._wants_status_report()
