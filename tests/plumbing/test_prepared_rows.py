"""nodepool.db.fetch_rows and insert_row: the prepared reads and writes of the grant path answer and
store exactly what the ORM does, on both databases and, on PostgreSQL, past the prepare threshold;
and the token authentication and role reads built on them keep knox's rules."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.db import IntegrityError, connection, transaction
from django.forms.models import model_to_dict
from django.utils import timezone
from rest_framework.test import APIClient

from fleet.events import Actor, record_event
from fleet.models import Node, NodeEvent, Pool
from leases import event_types as leases_events
from leases.models import Lease
from nodepool.api.permissions import CLIENTS, OPERATORS, in_group
from nodepool.db import fetch_rows, insert_row, insert_select, mark_inserted, prepared_cursor
from nodepool.tokens import create_user_token
from tests.factories import PoolFactory, make_schedulable_node
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db
ROUNDS = 3  # on PostgreSQL the first round prepares the statement, the later ones run it


def every_column(instance) -> dict:
    return {field.attname: getattr(instance, field.attname) for field in instance._meta.concrete_fields}


@pytest.fixture
def node():
    pool = PoolFactory(name="gpu", labels={"tier": "a"}, taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}])
    made, _ = make_schedulable_node(pool, hostname="n1", resources={"cpu": 4000})
    Node.objects.filter(pk=made.pk).update(labels={"zone": "z1", "n": 3}, ready=True)
    return Node.objects.get(pk=made.pk)


def test_fetch_rows_answers_what_the_orm_answers_for_every_column_type(node):
    for _ in range(ROUNDS):
        (pool,) = fetch_rows(Pool, "name", "gpu")
        assert every_column(pool) == every_column(Pool.objects.get(name="gpu"))  # JSON, timestamps, booleans
        (read,) = fetch_rows(Node, "id", node.pk)
        assert every_column(read) == every_column(Node.objects.get(pk=node.pk))  # a uuid key, JSON documents
        assert read._state.adding is False and read._state.db == "default"
        assert fetch_rows(Node, "pool_id", node.pool_id, limit=1)[0].pk == node.pk
        assert fetch_rows(Pool, "name", "no-such-pool") == []


def test_fetch_rows_reads_what_another_statement_changed_since_it_was_prepared(node):
    for i in range(ROUNDS):
        Pool.objects.filter(name="gpu").update(labels={"round": i})
        assert fetch_rows(Pool, "name", "gpu")[0].labels == {"round": i}


def event_fields(event) -> dict:
    return {k: v for k, v in model_to_dict(event).items() if k != "id"}


def test_insert_row_stores_what_save_stores(node):
    actor = Actor.system("test")
    before = timezone.now()
    for i in range(ROUNDS):
        event = record_event(
            node, leases_events.LEASE, actor, reason=f"r{i}", data={"i": i, "nested": [1, {"a": None}]}
        )
        assert event.pk is not None and event._state.adding is False  # the auto-increment key is read back
        stored = NodeEvent.objects.get(pk=event.pk)
        assert event_fields(stored) == event_fields(event)
        assert stored.data == {"i": i, "nested": [1, {"a": None}]} and stored.pool_id == node.pool_id
        assert before <= stored.created_at <= timezone.now()  # auto_now_add stamped, as save() does
    assert NodeEvent.objects.filter(node=node, reason__startswith="r").count() == ROUNDS


def _lease(node, workload_id: str, token: int) -> Lease:
    now = timezone.now()
    return Lease(
        workload_id=workload_id,
        fencing_token=token,
        node=node,
        node_incarnation=node.incarnation,
        pool_id=node.pool_id,
        resources={"cpu": 100},
        command=["sleep", "1"],
        spec={"workload_id": workload_id},
        ttl_seconds=60,
        expires_at=now + timedelta(seconds=60),
        granted_at=now,
    )


def test_insert_row_raises_the_constraint_error_and_writes_nothing(node):
    for i in range(ROUNDS):
        lease = insert_row(_lease(node, f"w{i}", 1))
        assert every_column(Lease.objects.get(pk=lease.pk)) == every_column(lease)
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_row(_lease(node, "w0", 2))  # a second live lease of the workload: the partial unique index
    assert Lease.objects.filter(workload_id="w0").count() == 1
    assert Lease.objects.count() == ROUNDS  # the connection is usable after the refusal


@pytest.mark.skipif(connection.vendor != "postgresql", reason="insert_select is for PostgreSQL's statements")
def test_insert_select_stores_each_instance_s_own_values_with_the_text_built_once(node):
    texts = set()
    for i in range(ROUNDS):
        lease = _lease(node, f"s{i}", i + 1)
        lease.command = ["sleep", str(i)]
        head, values, params = insert_select(lease, {"devices": f"jsonb_build_array({i})"})
        texts.add((head, values))
        with prepared_cursor() as cursor:
            cursor.execute(f"{head} SELECT {values}", params)
        mark_inserted(lease)
        stored = Lease.objects.get(pk=lease.pk)
        assert stored.devices == [i]  # the computed column
        assert {k: v for k, v in every_column(stored).items() if k != "devices"} == {
            k: v for k, v in every_column(lease).items() if k != "devices"
        }  # every other column from this instance, not from the first one the text was built for
    assert len(texts) == ROUNDS  # one text per computed expression
    again = insert_select(_lease(node, "s9", 9), {"devices": "jsonb_build_array(0)"})
    assert again[:2] in texts and "s9" in again[2]


# --- token authentication and roles on prepared reads ---------------------------------------------
def _api(key: str) -> APIClient:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return api


def test_a_token_authenticates_its_user_with_its_roles_and_nothing_else():
    carla = User.objects.create_user("carla")
    carla.groups.add(Group.objects.get_or_create(name=CLIENTS)[0])
    _, key = create_user_token(carla)
    for _ in range(ROUNDS):
        assert _api(key).get("/api/v1/node-leases").status_code == 200  # clients may list leases
        assert_problem(_api(key).get("/api/v1/machines"), 403, "forbidden")  # operators only
    wrong = key[:-4] + ("0000" if not key.endswith("0000") else "1111")  # same key prefix, another digest
    assert_problem(_api(wrong).get("/api/v1/node-leases"), 401, "authentication_failed")
    carla.groups.add(Group.objects.get_or_create(name=OPERATORS)[0])
    assert _api(key).get("/api/v1/machines").status_code == 200  # the roles are read at every request


def test_an_inactive_users_token_is_refused():
    user = User.objects.create_user("gone")
    _, key = create_user_token(user)
    User.objects.filter(pk=user.pk).update(is_active=False)
    assert_problem(_api(key).get("/api/v1/node-leases"), 401, "authentication_failed")


def test_in_group_reads_the_users_groups_once_per_user_object():
    user = User.objects.create_user(f"u-{uuid.uuid4().hex[:6]}")
    user.groups.add(Group.objects.get_or_create(name=CLIENTS)[0])
    assert in_group(user, CLIENTS) and not in_group(user, OPERATORS)
    assert user._nodepool_groups == set(user.groups.values_list("name", flat=True))


def test_tokens_that_share_a_key_each_authenticate_their_own_user_with_their_own_roles():
    """knox looks tokens up by their first 15 characters and tells them apart by digest: the one
    statement that reads tokens, users and roles keeps each token with its own user and groups."""
    from knox.crypto import hash_token
    from knox.models import AuthToken

    two_roles = User.objects.create_user("two-roles")
    two_roles.groups.add(Group.objects.get_or_create(name=CLIENTS)[0], Group.objects.get_or_create(name=OPERATORS)[0])
    no_role = User.objects.create_user("no-role")
    first, first_key = create_user_token(two_roles)
    second_key = first_key[:15] + uuid.uuid4().hex  # the same key, another secret
    AuthToken(digest=hash_token(second_key), token_key=first.token_key, user=no_role, expiry=first.expiry).save()
    for _ in range(ROUNDS):
        assert _api(first_key).get("/api/v1/machines").status_code == 200  # an operator
        assert_problem(_api(second_key).get("/api/v1/node-leases"), 403, "forbidden")  # no role at all
        assert _api(second_key).get("/api/v1/").status_code in (200, 403)  # authenticated, not 401


@pytest.mark.parametrize("model", [Lease, NodeEvent])
def test_nothing_listens_to_the_saves_insert_row_skips(model):
    """insert_row sends no pre_save/post_save: a receiver added for these models (or for every
    model) would silently miss grants and events, so it must come with save() back."""
    from django.db.models.signals import post_save, pre_save

    assert not pre_save.has_listeners(model) and not post_save.has_listeners(model)
