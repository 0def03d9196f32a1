"""Helpers shared by the fleet tests: pools, bootstrap tokens, enrollment payloads, attestation keys."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.utils import timezone

from fleet.models import Pool
from fleet.services import bootstrap_token_create
from tests.factories import PoolFactory
from tests.support import node_api  # noqa: F401  (re-exported: the fleet tests import it from here)

ENROLL = "/api/v1/node-enrollments"


def make_pool(**fields) -> Pool:
    return PoolFactory(**fields)


def make_token(pool: Pool, *, max_uses: int = 5, ttl: int = 3600, owner=None) -> str:
    _, secret = bootstrap_token_create(
        pool=pool, expires_at=timezone.now() + timedelta(seconds=ttl), max_uses=max_uses, owner=owner
    )
    return secret


def enrollment(token: str, **overrides) -> dict:
    body = {
        "bootstrap_token": token,
        "hostname": "h1.example.test",
        "display_name": "",
        "addresses": ["10.0.0.4"],
        "agent_version": "1.0.0",
        "labels": {"zone": "a"},
        "capability": {
            "resources": {"cpu": "8", "memory": "32Gi", "ephemeral-storage": "100Gi"},
            "features": {"arch": "amd64", "os": "linux", "kernel": "6.1", "runtimes": ["containerd"]},
        },
    }
    body.update(overrides)
    return body


def enroll(api, token: str, **overrides):
    return api.post(ENROLL, enrollment(token, **overrides), format="json")


class Signer:
    """An Ed25519 key pair for attestation tests."""

    def __init__(self):
        self.key = Ed25519PrivateKey.generate()

    @property
    def public_pem(self) -> str:
        return (
            self.key.public_key()
            .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
            .decode()
        )

    def attest(self, claims: dict) -> dict:
        document = json.dumps(claims).encode()
        return {
            "document": base64.b64encode(document).decode(),
            "signature": base64.b64encode(self.key.sign(document)).decode(),
        }


import pytest  # noqa: E402


@pytest.fixture(autouse=False)
def fresh_throttles():
    """Throttle counters live in the cache; start each test with none spent."""
    from django.core.cache import cache

    cache.clear()
    yield
    cache.clear()
