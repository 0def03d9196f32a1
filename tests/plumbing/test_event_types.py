"""Each app owns its words: the event types of the one event table are declared per app
(fleet.event_types), the stored values never change, and the events API reads the registry."""

from __future__ import annotations

import pytest

from fleet import event_types
from fleet.models import NodeEvent

# Every stored value as of round 3, by the app that declares it: values on disk and in clients'
# filters, so none may change or move to a type another app declared.
STORED = {
    "fleet": {
        "enrolled", "lifecycle", "admission_check", "benchmark", "liveness", "readiness", "condition",
        "health", "restart", "clock_skew", "credential", "policy", "guard", "clock_jump", "security", "device",
    },
    "leases": {"lease", "checkpoint"},
    "maintenance": {"drain", "quarantine", "hold"},
    "operations": {"upgrade", "scale", "preemption", "disruption_blocked", "repair", "repair_breaker"},
    "marketplace": {"usage", "statement", "appeal"},
}  # fmt: skip


def test_each_app_declares_its_own_event_types_with_the_stored_values():
    declared: dict[str, set[str]] = {}
    for declared_type in event_types.registered():
        declared.setdefault(declared_type.app, set()).add(str(declared_type))
    for app, values in STORED.items():
        assert values <= declared.get(app, set()), app


def test_the_field_and_the_filter_offer_every_declared_type():
    from fleet.filtersets import EventFilterSet

    values = {str(t) for t in event_types.registered()}
    assert {value for value, _label in NodeEvent._meta.get_field("type").choices} == values
    assert {value for value, _label in EventFilterSet().filters["type"].extra["choices"]()} == values


def test_only_statements_and_appeals_are_private():
    assert event_types.private_types() == {"statement", "appeal"}


def test_a_type_declared_by_another_app_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        event_types.declare("lease", "a lease, again")
    assert event_types.lookup("enrolled") is event_types.ENROLLED


@pytest.mark.django_db
def test_the_events_api_filters_on_a_type_an_upper_app_declared(operator_api):
    from fleet.events import Actor, record_event
    from maintenance.event_types import DRAIN
    from tests.factories import NodeFactory

    node = NodeFactory()
    record_event(node, DRAIN, Actor.system("test"), reason="drained")
    body = operator_api.get("/api/v1/events", {"type": "drain"}).json()
    assert [event["type"] for event in body["results"]] == ["drain"]
    bad = operator_api.get("/api/v1/events", {"type": "no_such_type"})
    assert bad.status_code == 400
