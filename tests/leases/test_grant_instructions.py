"""A grant raises the node's LEASES instruction bit only when it is down, and never loses it.

The grant reads the node's pending-instruction bits under the hold it already takes on the node
row (``leases.grant._hold_schedulable_node``); when LEASES is up it skips the UPDATE (and, on
PostgreSQL, the separate COMMIT that follows the grant's). That is safe only because a status
report, which clears the bits and then lists the node's leases, has to wait for that hold: the
race below shows the lease is never lost to the node.
"""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from fleet.instructions import Instruction
from fleet.models import Node
from tests.factories import PoolFactory, make_schedulable_node
from tests.heartbeat_support import node_api, post_beat
from tests.races import Hold, race
from tests.support import grant


def _instruction_updates(queries) -> list[str]:
    return [q["sql"] for q in queries if q["sql"].startswith("UPDATE") and '"instructions"' in q["sql"]]


@pytest.mark.django_db
def test_a_grant_raises_the_lease_bit_once_and_skips_the_update_while_it_is_up(
    client_user, django_capture_on_commit_callbacks
):
    node, secret = make_schedulable_node(PoolFactory(name="general"))
    with CaptureQueriesContext(connection) as first, django_capture_on_commit_callbacks(execute=True):
        first_lease = grant(client_user, "job-1")
    assert len(_instruction_updates(first.captured_queries)) == 1
    assert Node.objects.get(pk=node.pk).instructions & Instruction.LEASES

    with CaptureQueriesContext(connection) as second, django_capture_on_commit_callbacks(execute=True):
        second_lease = grant(client_user, "job-2")
    assert _instruction_updates(second.captured_queries) == []
    assert Node.objects.get(pk=node.pk).instructions & Instruction.LEASES

    # The node's status report clears the bits and lists both leases; the next grant raises LEASES again.
    report = post_beat(node_api(secret), node, sequence=1).json()
    assert {lease["lease_id"] for lease in report["leases"]} == {str(first_lease.pk), str(second_lease.pk)}
    assert not Node.objects.get(pk=node.pk).instructions & Instruction.LEASES
    with CaptureQueriesContext(connection) as third, django_capture_on_commit_callbacks(execute=True):
        grant(client_user, "job-3")
    assert len(_instruction_updates(third.captured_queries)) == 1
    assert Node.objects.get(pk=node.pk).instructions & Instruction.LEASES


@pytest.mark.race
@pytest.mark.django_db(transaction=True)
def test_a_status_report_racing_a_grant_that_skipped_the_bit_never_hides_the_lease(client_user):
    node, secret = make_schedulable_node(PoolFactory(name="general"))
    assert post_beat(node_api(secret), node, sequence=1).status_code == 200
    grant(client_user, "job-1")  # raises LEASES (committed: this test's transactions are real)
    assert Node.objects.get(pk=node.pk).instructions & Instruction.LEASES
    # The second grant stops right after reading the bit (up, so it will not raise it again) and
    # holding the node; the node's status report starts then and clears the bits.
    inside = Hold("leases.grant._hold_schedulable_node", parties=2, timeout=1.0)

    def act(index):
        if index == 0:
            assert inside.arrived.wait(10), "the grant never reached its critical section"
            return post_beat(node_api(secret), node, sequence=2)
        return grant(client_user, "job-2").pk

    with inside:
        outcome = race(act, 2)
    assert not outcome.errors, outcome.errors
    report = outcome.results[0]
    assert report.status_code == 200, report.content
    listed = {lease["lease_id"] for lease in report.json()["leases"]}
    bit_up = Node.objects.get(pk=node.pk).instructions & Instruction.LEASES
    # Either the report waited for the grant and lists its lease, or the bit is still up for the next renewal.
    assert str(outcome.results[1]) in listed or bit_up, (listed, bit_up)
