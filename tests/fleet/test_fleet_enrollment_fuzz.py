"""Whatever a client sends as capability or labels, enrollment answers 201 or a 4xx problem — never a 500."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.models import Node
from tests.fleet_support import enroll, fresh_throttles, make_pool, make_token  # noqa: F401

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
capabilities = (
    st.fixed_dictionaries(
        {},
        optional={
            "resources": st.dictionaries(st.sampled_from(["cpu", "memory", "nvidia.com/gpu", "x y"]), json_values),
            "accelerators": json_values,
            "features": json_values,
        },
    )
    | json_values
)


@pytest.mark.django_db
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capability=capabilities, labels=json_values)
def test_arbitrary_capability_and_labels_never_break_enrollment(anon_api, fresh_throttles, capability, labels):  # noqa: F811
    token = make_token(make_pool(name="fuzz"), max_uses=1000)
    before = Node.objects.count()
    response = enroll(anon_api, token, capability=capability, labels=labels)
    assert response.status_code in (201, 400, 422), response.content
    if response.status_code != 201:
        assert response["Content-Type"] == "application/problem+json"
        assert Node.objects.count() == before


@pytest.mark.django_db
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_in_raw_json_are_refused(anon_api, fresh_throttles, literal):  # noqa: F811
    token = make_token(make_pool(name="fuzz"))
    body = {"bootstrap_token": token, "agent_version": "1.0.0", "capability": {"resources": {"cpu": "CPU"}}}
    raw = json.dumps(body).replace('"CPU"', literal)
    response = anon_api.post("/api/v1/node-enrollments", raw, content_type="application/json")
    assert response.status_code == 400
    assert Node.objects.count() == 0
