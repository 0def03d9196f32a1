"""The autoscaling webhook URL leads only where the server may call (issue 30, item 3).

Every form the security trial stored is refused when written (400, nothing stored); a URL
stored before the check (or a name that later resolves inward) is refused when called, and the
failure recorded is a fixed summary, never the remote body.
"""

from __future__ import annotations

import pytest
from django.utils import timezone

from fleet.events import Actor
from operations import demand
from operations.models import PoolOperations, ScaleDecision
from tests.egress_support import stub_dns
from tests.factories import PoolFactory, make_schedulable_node
from tests.plumbing.test_egress import TRIAL_FORMS


@pytest.mark.parametrize("url", [u for u in TRIAL_FORMS if "\n" not in u])
def test_a_webhook_url_to_an_internal_destination_is_refused_and_nothing_stored(operator_api, url):
    PoolFactory(name="general")
    body = {"provider": "webhook", "provider_url": url, "provider_secret": "s"}
    response = operator_api.patch("/api/v1/pools/general/operations", body, format="json", HTTP_IF_MATCH='"1"')
    assert (response.status_code, response.json()["code"]) == (400, "invalid_pool_operations"), response.content
    assert response.json()["errors"][0]["field"] == "provider_url"
    assert not PoolOperations.objects.filter(provider_url=url).exists()


@pytest.mark.parametrize("url", ["http://provider.example/scale\r\nX-Injected: 1", "http://a.example/\n"])
def test_a_url_with_cr_or_lf_is_refused_whatever_the_provider(operator_api, url):
    PoolFactory(name="general")
    body = {"provider": "simulated", "provider_url": url}
    response = operator_api.patch("/api/v1/pools/general/operations", body, format="json", HTTP_IF_MATCH='"1"')
    assert (response.status_code, response.json()["code"]) == (400, "invalid_pool_operations")


def test_switching_a_loopback_url_to_the_webhook_provider_is_refused(operator_api):
    """The simulated provider hands its URL to a simulator (the control plane's own address,
    often loopback); the server never calls it. Turning it into a webhook is checked."""
    PoolFactory(name="general")
    body = {"provider": "simulated", "provider_url": "http://127.0.0.1:8000"}
    ok = operator_api.patch("/api/v1/pools/general/operations", body, format="json", HTTP_IF_MATCH='"1"')
    assert ok.status_code == 200, ok.content
    refused = operator_api.patch(
        "/api/v1/pools/general/operations", {"provider": "webhook"}, format="json", HTTP_IF_MATCH='"2"'
    )
    assert (refused.status_code, refused.json()["errors"][0]["field"]) == (400, "provider_url")


def test_a_stored_webhook_that_resolves_to_the_metadata_service_is_not_called(client_api, monkeypatch, settings):
    settings.NODEPOOL = {**settings.NODEPOOL, "PROVIDER_MAX_ATTEMPTS": 1}
    stub_dns(monkeypatch, {"metadata.google.internal": ["169.254.169.254"]})
    pool = PoolFactory(name="general")
    make_schedulable_node(pool, resources={"cpu": 4000, "memory": 2**34})
    PoolOperations.objects.create(
        pool=pool, provider="webhook", provider_url="http://metadata.google.internal/computeMetadata/v1/",
        provider_secret="s", min_nodes=0, max_nodes=3, scale_up_delay=0, scale_up_cooldown=0,
        node_template={"resources": {"cpu": 4000, "memory": 2**33}, "labels": {}, "taints": [], "features": {}},
    )  # fmt: skip
    client_api.post("/api/v1/node-leases", {"workload_id": "busy", "pool": "general", "resources": {"cpu": "3"}},
                    format="json")  # fmt: skip
    queued = client_api.post(
        "/api/v1/node-leases", {"workload_id": "job-1", "pool": "general", "resources": {"cpu": "3"}, "queue": True},
        format="json",
    )  # fmt: skip
    assert queued.status_code == 202, queued.content
    demand.scale_up(pool_id=pool.pk, actor=Actor.system("system:autoscaler"), now=timezone.now())
    decision = ScaleDecision.objects.get(direction="up")
    assert decision.outcome == "failed"
    assert "destination not allowed" in decision.error and "link-local" in decision.error
