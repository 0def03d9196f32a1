"""On SQLite the project's IMMEDIATE transactions are what serialises writers (row locks from
``select_for_update`` do not exist there), so the race tests' locks are proven on PostgreSQL and
this checks that the SQLite half of the guarantee is in force."""

import threading
import time

import pytest
from django.db import connection, transaction

from tests.races import race

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.skipif("connection.vendor != 'sqlite'")
def test_sqlite_transactions_begin_immediate_so_a_second_writer_waits_for_the_first():
    assert connection.settings_dict["OPTIONS"]["transaction_mode"] == "IMMEDIATE"
    first_in = threading.Event()
    times = {}

    def transactions(index):
        if index == 1:
            first_in.wait(10)
        with transaction.atomic():  # no statement inside: only BEGIN can take the write lock
            times[f"{index}_in"] = time.monotonic()
            if index == 0:
                first_in.set()
                time.sleep(0.3)
                times["0_out"] = time.monotonic()

    outcome = race(transactions, 2)

    assert not outcome.errors, outcome.errors
    # With SQLite's default DEFERRED mode the second BEGIN would not wait at all.
    assert times["1_in"] >= times["0_out"], "the second transaction began only after the first ended"
