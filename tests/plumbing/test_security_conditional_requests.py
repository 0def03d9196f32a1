"""RFC 9110 conditional requests: the RFC's own examples (issue 11, item 10)."""

from __future__ import annotations

import pytest

from nodepool.api.versioning import etags_match, parse_entity_tags
from tests.factories import PoolFactory, make_schedulable_node

# RFC 9110 §8.8.3.2, the comparison table.
COMPARISONS = [
    ('W/"1"', 'W/"1"', False, True),
    ('W/"1"', 'W/"2"', False, False),
    ('W/"1"', '"1"', False, True),
    ('"1"', '"1"', True, True),
]


@pytest.mark.parametrize(("a", "b", "strong", "weak"), COMPARISONS)
def test_the_rfc_comparison_table(a, b, strong, weak):
    (tag_a,), (tag_b,) = parse_entity_tags(a), parse_entity_tags(b)
    assert etags_match(tag_a, tag_b, weak=False) is strong
    assert etags_match(tag_a, tag_b, weak=True) is weak


@pytest.mark.parametrize(
    ("header", "tags"),
    [
        ('"xyzzy"', [(False, "xyzzy")]),  # RFC 9110 §13.1.1 examples
        ('"xyzzy", "r2d2xxxx", "c3piozzzz"', [(False, "xyzzy"), (False, "r2d2xxxx"), (False, "c3piozzzz")]),
        ('W/"xyzzy", W/"r2d2xxxx"', [(True, "xyzzy"), (True, "r2d2xxxx")]),  # §13.1.2 examples
        ('"a,b", "c"', [(False, "a,b"), (False, "c")]),  # a comma inside a tag is part of it
        ('""', [(False, "")]),
    ],
)
def test_entity_tag_lists_parse_like_the_rfc_examples(header, tags):
    assert parse_entity_tags(header) == tags


@pytest.mark.parametrize("header", ["xyzzy", '"xyzzy', 'W/ "x"', '"x" "y"', '"x";"y"', "7", 'w/"7"'])
def test_malformed_entity_tag_lists_are_refused(header):
    assert parse_entity_tags(header) is None


@pytest.mark.django_db
def test_if_none_match_on_get_gives_304_when_the_version_is_unchanged(operator_api):
    node, _ = make_schedulable_node(PoolFactory())
    first = operator_api.get(f"/api/v1/nodes/{node.pk}")
    etag = first["ETag"]

    same = operator_api.get(f"/api/v1/nodes/{node.pk}", HTTP_IF_NONE_MATCH=etag)
    weak = operator_api.get(f"/api/v1/nodes/{node.pk}", HTTP_IF_NONE_MATCH=f'"0", W/{etag}')
    star = operator_api.get(f"/api/v1/nodes/{node.pk}", HTTP_IF_NONE_MATCH="*")
    other = operator_api.get(f"/api/v1/nodes/{node.pk}", HTTP_IF_NONE_MATCH='"999"')

    for response in (same, weak, star):
        assert response.status_code == 304 and response["ETag"] == etag and response.content == b""
    assert other.status_code == 200 and other.json()["id"] == str(node.pk)


@pytest.mark.django_db
def test_a_representation_that_moved_without_the_version_is_sent_again_not_304(operator_api, client_api):
    """A grant changes the node's free capacity and recent events but not its version: a GET with
    the ETag read before the grant gets the new representation (200), not a stale 304. The ETag
    covers the representation; If-Match still names the version, so the older ETag acts."""
    pool = PoolFactory()
    node, _ = make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**30})
    before = operator_api.get(f"/api/v1/nodes/{node.pk}")
    granted = client_api.post(
        "/api/v1/node-leases", {"pool": pool.name, "workload_id": "w-1", "resources": {"cpu": "1"}}, format="json"
    )
    assert granted.status_code == 201

    again = operator_api.get(f"/api/v1/nodes/{node.pk}", HTTP_IF_NONE_MATCH=before["ETag"])
    assert again.status_code == 200
    assert again.json()["capacity"]["cpu"]["free"] == 3000
    assert again.json()["version"] == before.json()["version"]
    assert again["ETag"] != before["ETag"]
    assert operator_api.get(f"/api/v1/nodes/{node.pk}", HTTP_IF_NONE_MATCH=again["ETag"]).status_code == 304

    cordoned = operator_api.post(
        f"/api/v1/nodes/{node.pk}/cordon", {"reason": "look"}, format="json", HTTP_IF_MATCH=before["ETag"]
    )
    assert cordoned.status_code == 200
    stale = operator_api.post(
        f"/api/v1/nodes/{node.pk}/uncordon", {"reason": "done"}, format="json", HTTP_IF_MATCH=before["ETag"]
    )
    assert stale.status_code == 412
    weak = operator_api.post(
        f"/api/v1/nodes/{node.pk}/uncordon", {"reason": "done"}, format="json", HTTP_IF_MATCH=f"W/{cordoned['ETag']}"
    )
    assert weak.status_code == 412


@pytest.mark.parametrize(
    ("opaque", "version"),
    [("7", 7), ("7.0a1b2c3d4e5f", 7), ("7.", None), ("7.XYZ", None), ("x7", None), (str(2**63), None), ("", None)],
)
def test_if_match_reads_the_version_of_the_tags_it_issues_only(opaque, version):
    from nodepool.api.versioning import version_in_tag

    assert version_in_tag(opaque) == version


@pytest.mark.django_db
def test_a_pending_requests_clock_derived_wait_does_not_defeat_if_none_match(client_api, time_machine):
    """pending_seconds moves at every read; the ETag leaves it out, so a poller gets 304 while
    nothing about the request changed, and the new representation once something did."""
    from datetime import timedelta

    from django.utils import timezone

    from leases.models import LeaseRequest

    time_machine.move_to(timezone.now(), tick=False)
    make_schedulable_node(PoolFactory(name="general"), resources={"cpu": 4000, "memory": 2**34})
    body = {"workload_id": "first", "pool": "general", "resources": {"cpu": "4"}}
    assert client_api.post("/api/v1/node-leases", body, format="json").status_code == 201
    queued = client_api.post("/api/v1/node-leases", {**body, "workload_id": "big", "queue": True}, format="json")
    url = f"/api/v1/lease-requests/{queued.json()['lease_request']}"
    first = client_api.get(url)
    time_machine.shift(timedelta(seconds=30))
    again = client_api.get(url, HTTP_IF_NONE_MATCH=first["ETag"])
    assert again.status_code == 304
    LeaseRequest.objects.filter(pk=queued.json()["lease_request"]).update(message="changed")
    assert client_api.get(url, HTTP_IF_NONE_MATCH=first["ETag"]).status_code == 200
