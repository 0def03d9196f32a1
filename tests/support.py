"""Small helpers every area's tests share: a node's API client and granting a lease.

Kept here once (they were written three times each); area-specific helpers stay in
``fleet_support``, ``heartbeat_support`` and ``maintenance_support``.
"""

from __future__ import annotations

from rest_framework.test import APIClient

ACTOR_NAME = "test"


def node_api(secret: str) -> APIClient:
    """An API client that authenticates as a node (``Authorization: Node <credential>``)."""
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Node {secret}")
    return api


def lease_body(workload_id: str = "job-1", *, pool: str = "general", cpu: str = "1", **extra) -> dict:
    """A ``POST /node-leases`` body (docs/api-contract.md); ``extra`` adds or overrides fields."""
    body = {"workload_id": workload_id, "pool": pool, "resources": {"cpu": cpu}}
    body.update(extra)
    return body


def grant(user, workload_id: str = "job-1", *, pool: str = "general", cpu: str = "1", **extra):
    """Grant a lease through ``leases.services.lease_create`` and return the ``Lease``.

    Fails the test (AssertionError) when the service queues or refuses instead of granting;
    use :func:`grant_status` where a refusal is an expected outcome.
    """
    from fleet.events import Actor
    from leases.services import lease_create

    lease, status = lease_create(
        data=lease_body(workload_id, pool=pool, cpu=cpu, **extra), client=user, actor=Actor.system(ACTOR_NAME)
    )
    assert status == 201, f"expected a granted lease, got {status}"
    return lease


def grant_status(user, workload_id: str = "job-1", *, pool: str = "general", cpu: str = "1", **extra):
    """Like :func:`grant` but returns the HTTP status the API would answer (201, 202, 409…)."""
    from fleet.events import Actor
    from leases.services import lease_create

    try:
        _, status = lease_create(
            data=lease_body(workload_id, pool=pool, cpu=cpu, **extra), client=user, actor=Actor.system(ACTOR_NAME)
        )
        return status
    except Exception as exc:  # an API problem carries its status; anything else is a failure to show
        return getattr(exc, "status_code", repr(exc))


def staff_client(user):
    """A Django test ``Client`` logged in to the admin as ``user`` (made staff)."""
    from django.test import Client

    user.is_staff = True
    user.save()
    browser = Client()
    browser.force_login(user)
    return browser
