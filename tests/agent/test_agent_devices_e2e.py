"""Issue 27, "Done when": a real agent on a host whose (fake) nvidia-smi shows 8 GPUs runs two
4-GPU leases, and each workload's environment names four GPUs no other workload sees.

End to end: the real app (in process, over HTTP through tests/control_plane.py), admission on a
real Celery worker (another process, on the test database), the real agent (enrollment, status
reports with its devices, the benchmark, lease workloads as subprocesses), grants through the
lease service. No GPU anywhere: the fake nvidia-smi (tests/gpu_support.py) answers in NVIDIA's
formats.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from fleet import tasks as fleet_tasks
from fleet.choices import Lifecycle
from fleet.events import Actor
from fleet.models import Device, Node
from fleet.services import node_admit
from leases.models import Lease
from tests.control_plane import ControlPlane
from tests.gpu_support import write_fake_nvidia_smi
from tests.processes import running

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("no_flood_guard"),
]
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NODEPOOL_DEVICES", "NODEPOOL_LEASE_ID")
# Each workload writes what it was given, then runs until stopped (both run at the same time).
WORKLOAD = (
    f"import json, os, time; keys = {ENV_KEYS!r}; "
    "seen = json.dumps({k: os.environ.get(k) for k in keys}); "
    "open(os.environ['NODEPOOL_LEASE_ID'] + '.env.json', 'w').write(seen); "
    "time.sleep(120)"
)


def _until(predicate, agent, what: str, timeout: float = 60.0) -> None:
    """Step the agent (heartbeats, lease events, the benchmark's post) until ``predicate()``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        agent.step()
        agent.tick(until=time.monotonic() + 0.2)


@pytest.mark.parametrize("broker", ["embedded"], indirect=True)
def test_two_4_gpu_leases_on_an_8_gpu_host_each_see_four_different_gpus(broker, tmp_path, monkeypatch):
    fake = write_fake_nvidia_smi(tmp_path / "bin", 8, nvlink_groups=2)
    monkeypatch.setenv("PATH", fake.path())
    cp = ControlPlane({"gpu": {}}, heartbeat_interval=10)
    agent = cp.make_agent(tmp_path / "agent", renewals=False, benchmark_cpu_seconds=0.2)
    try:
        agent.start()  # enrolls; declares nvidia.com/gpu: 8
        agent.step()  # the first status report carries the eight devices
        node = Node.objects.get(pk=agent.state.node_id)
        assert sorted(Device.objects.filter(node=node).values_list("device_id", flat=True)) == sorted(fake.uuids)

        # Every admission run the product dispatches (the operator's admit, the benchmark's result)
        # goes to the worker through the real broker, not inline.
        client = broker.client()
        sent = []

        def to_the_worker(args=None, kwargs=None, **options):  # delay() calls apply_async() too
            sent.append(args)
            return client.send_task("fleet.run_admission", args=list(args or ()), kwargs=kwargs)

        monkeypatch.setattr(fleet_tasks.run_admission, "apply_async", to_the_worker)
        with running(broker.worker_args(), broker.env(), broker.log):
            node_admit(node_id=node.pk, expected_version=node.version, actor=Actor.system("test:operator"))
            _until(lambda: Node.objects.get(pk=node.pk).lifecycle == Lifecycle.READY, agent, "admission")
        assert sent and "fleet.run_admission" in broker.log_text()
        assert Device.objects.filter(node=node, verified_at__isnull=False).count() == 8

        command = [sys.executable, "-c", WORKLOAD]
        leases = [
            cp.grant_lease(command, pool="gpu", resources={"cpu": "100m", "nvidia.com/gpu": "4"}) for _ in range(2)
        ]
        seen = {}
        work = agent.supervisor.work_dir

        def both_started():
            for lease in leases:
                path = work / f"{lease.pk}.env.json"
                if path.exists() and path.stat().st_size:
                    seen[str(lease.pk)] = json.loads(path.read_text())
            return len(seen) == 2

        _until(both_started, agent, "both workloads")
        running_now = {w.lease_id for w in agent.supervisor.running()}
    finally:
        agent.shutdown()
        cp.close()

    assert running_now == {str(lease.pk) for lease in leases}, "the two workloads ran at the same time"
    given = {}
    for lease in leases:
        env = seen[str(lease.pk)]
        ids = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert len(ids) == 4 and len(set(ids)) == 4
        assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == env["NODEPOOL_DEVICES"]
        assert set(ids) <= set(fake.uuids)
        granted = [d["id"] for d in Lease.objects.get(pk=lease.pk).devices]
        assert ids == granted, "the workload sees exactly the lease's devices, in its order"
        given[str(lease.pk)] = set(ids)
    first, second = given.values()
    assert not first & second, "no GPU is seen by both workloads"
    assert first | second == set(fake.uuids)
