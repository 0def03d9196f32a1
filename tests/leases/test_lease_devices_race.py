"""Two clients racing for the last free GPU of a node: the database's guards let exactly one win.

The count resource is deliberately set wider than the devices here, so that the device guards are
the only ones between the racers. Two paths claim devices (leases.devices.claim):

* the general path (any request with tolerations, co-location, several device requests, or on
  SQLite) reads the node's devices, chooses in Python and inserts LeaseDevice rows: there the
  partial unique index on live LeaseDevice rows (``leasedevice_one_live_holder``) is the only
  guard. :class:`tests.races.Hold` keeps both racers inside the grant after they chose and before
  either inserted, so without that index both would hold the same GPU on every run (the second
  test);
* PostgreSQL's one-statement claim picks ``FOR NO KEY UPDATE SKIP LOCKED`` and marks ``claimed``
  in the same statement, so a racer never picks a device another is claiming; the unique index
  stays behind it (the first test).
"""

from __future__ import annotations

import pytest
from django.db import connection

from fleet.models import NodeResource
from leases.models import Lease, LeaseDevice
from tests.device_support import claimed_disagreements, make_gpu_node
from tests.factories import PoolFactory
from tests.races import Hold, race
from tests.support import grant_status


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_clients_racing_for_the_last_free_gpu_of_a_node_exactly_one_wins(client_user):
    node, _ = make_gpu_node(PoolFactory(name="gpu"), count=2)
    assert grant_status(client_user, "first", pool="gpu", cpu="1", resources={"nvidia.com/gpu": 1}) == 201
    NodeResource.objects.filter(node=node, name="nvidia.com/gpu").update(capacity=16, allocatable=16)

    # Held right after the claim's statement (PostgreSQL picks and holds in one, claim_plain): the
    # first racer cannot commit before the second has picked from the same snapshot; the second
    # passes over the locked GPU, then (waiting, in its second round) finds it taken.
    with Hold("leases.sql.devices.claim_plain", parties=2, timeout=1.0):
        outcome = race(
            lambda i: grant_status(client_user, f"racer-{i}", pool="gpu", cpu="1", resources={"nvidia.com/gpu": 1}), 2
        )
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == [201, 409]
    assert claimed_disagreements() == []
    held = list(LeaseDevice.objects.filter(live=True).values_list("device__device_id", flat=True))
    assert sorted(held) == ["GPU-n-0000", "GPU-n-0001"]
    assert Lease.objects.filter(state="granted").count() == 2


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_two_clients_choosing_the_same_last_gpu_only_the_unique_index_lets_one_win(client_user):
    node, _ = make_gpu_node(PoolFactory(name="gpu"), count=2)
    body = {"resources": {"nvidia.com/gpu": 1}, "tolerations": [{"operator": "Exists"}]}  # the general path
    assert grant_status(client_user, "first", pool="gpu", cpu="1", **body) == 201
    NodeResource.objects.filter(node=node, name="nvidia.com/gpu").update(capacity=16, allocatable=16)

    # Both have chosen GPU-n-0001 from their snapshot before either inserts its claim.
    with Hold("leases.devices.choose", parties=2, timeout=1.0) as hold:
        outcome = race(lambda i: grant_status(client_user, f"racer-{i}", pool="gpu", cpu="1", **body), 2)
    if connection.vendor == "postgresql":  # SQLite runs one writing transaction at a time
        assert hold.max_inside == 2  # both chose the GPU: the index, not a lock, decides
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == [201, 409]
    assert claimed_disagreements() == []
    held = list(LeaseDevice.objects.filter(live=True).values_list("device__device_id", flat=True))
    assert sorted(held) == ["GPU-n-0000", "GPU-n-0001"]


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_a_whole_gpu_and_its_mig_slice_racing_never_both_win(client_user):
    from fleet.devices import sync_counts
    from fleet.models import Device, Node
    from tests.device_support import gpu, report_devices

    node, _ = make_gpu_node(PoolFactory(name="gpu"), count=1)
    parent = Device.objects.get(node=node)
    mig = {"id": "MIG-0", "type": "nvidia.com/mig", "index": 0, "mig_profile": "3g.40gb", "parent": parent.device_id}
    report_devices(node, [gpu(0), mig])
    Device.objects.filter(node=node).update(verified_at=parent.verified_at)
    sync_counts(Node.objects.get(pk=node.pk))
    bodies = [{"resources": {"nvidia.com/gpu": 1}}, {"resources": {"nvidia.com/mig": 1}}]

    with Hold("leases.devices.choose", parties=2, timeout=1.0):
        outcome = race(lambda i: grant_status(client_user, f"racer-{i}", pool="gpu", cpu="1", **bodies[i]), 2)
    assert not outcome.errors, outcome.errors
    assert sorted(outcome.results) == [201, 409]
    assert claimed_disagreements() == []
