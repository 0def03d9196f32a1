"""A signed-in user with no role gets 403 on every endpoint of the schema (issue 11, item 7).

The list of endpoints is the live OpenAPI schema, so endpoints added later are covered too. An
endpoint that lets anonymous callers in (enrollment) is not a user endpoint and is left out.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.db import connection

from tests.conftest import _api
from tests.problems import assert_problem
from tests.schema_operations import schema_operations

OPERATIONS = [op for op in schema_operations() if not op.anonymous]


def test_the_schema_lists_the_endpoints_this_test_relies_on():
    names = {str(op) for op in OPERATIONS}
    assert {"GET /api/v1/drains", "GET /api/v1/quarantines", "POST /api/v1/fencing/validate"} <= names
    assert len(OPERATIONS) > 30


@pytest.mark.django_db
@pytest.mark.parametrize("operation", OPERATIONS, ids=str)
def test_a_user_with_no_role_gets_403_and_changes_nothing(operation, django_assert_max_num_queries):
    api = _api(User.objects.create_user("no-role"))
    tables = connection.introspection.table_names()
    apps = ("fleet_", "leases_", "maintenance_", "operations_", "marketplace_")
    before = {t: _count(t) for t in tables if t.startswith(apps)}

    kwargs = {"format": "json", "HTTP_IF_MATCH": '"1"'}
    response = getattr(api, operation.method)(operation.path, {}, **kwargs)

    assert_problem(response, 403, "forbidden")
    assert {t: _count(t) for t in before} == before


def _count(table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT COUNT(*) FROM "{table}"')
        return cursor.fetchone()[0]
