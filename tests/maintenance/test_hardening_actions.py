"""An operator action whose view never reads the body still refuses a body that is not JSON it can accept.

Before: ``POST /node-leases/{id}/checkpoint`` with a good ``If-Match`` never parsed the body, so
``{"reason": NaN}`` or plain garbage was answered 200 and the checkpoint was requested. The body
is now parsed whenever the expected version is read (``nodepool.api.versioning.expected_version``).
"""

from __future__ import annotations

import pytest
from django.core.cache import cache

from tests.factories import make_schedulable_node
from tests.maintenance_support import make_lease
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_throttle_counts():
    cache.clear()
    yield
    cache.clear()


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ('{"reason": NaN}', "non_finite_number"),
        ("{not json", "malformed_body"),
        ('{"reason": "a\\u0000"}', "nul_character"),
    ],
)
def test_a_checkpoint_with_an_unparseable_body_is_400_and_nothing_is_requested(operator_api, raw, code):
    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-1")

    response = operator_api.generic(
        "POST",
        f"/api/v1/node-leases/{lease.pk}/checkpoint",
        raw.encode(),
        content_type="application/json",
        HTTP_IF_MATCH=f'"{lease.version}"',
    )

    assert_problem(response, 400, code)
    lease.refresh_from_db()
    assert lease.checkpoint_requested_at is None


def test_a_checkpoint_with_if_match_and_no_body_still_works(operator_api):
    node, _ = make_schedulable_node()
    lease = make_lease(node, "job-1")

    response = operator_api.post(f"/api/v1/node-leases/{lease.pk}/checkpoint", HTTP_IF_MATCH=f'"{lease.version}"')

    assert response.status_code == 200, response.content
    lease.refresh_from_db()
    assert lease.checkpoint_requested_at is not None
