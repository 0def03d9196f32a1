"""Bearer secrets (bootstrap tokens, node credentials): random, shown once, stored hashed.

A secret reads ``<kind>_<prefix>.<random>``. The prefix is not secret: it is the lookup key,
so that verification is one indexed query plus a constant-time comparison of SHA-256 digests.
SHA-256 (not a password hash) is right here because the secrets carry 256 bits of entropy:
there is nothing to brute-force (the same reasoning as GitHub's and Django REST Knox's tokens).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PREFIX_LENGTH = 12


def new_secret(kind: str) -> tuple[str, str, str]:
    """Return ``(full_secret, prefix, sha256_hex)`` for a new random secret of ``kind``."""
    prefix = secrets.token_hex(PREFIX_LENGTH // 2)
    full = f"{kind}_{prefix}.{secrets.token_urlsafe(32)}"
    return full, prefix, hash_secret(full)


def hash_secret(full: str) -> str:
    return hashlib.sha256(full.encode()).hexdigest()


def split_prefix(full: str, kind: str) -> str | None:
    """The lookup prefix of ``full`` if it has the shape of a ``kind`` secret, else ``None``."""
    head, dot, _ = full.partition(".")
    if not dot or not head.startswith(kind + "_"):
        return None
    prefix = head[len(kind) + 1 :]
    return prefix if len(prefix) == PREFIX_LENGTH else None


def matches(full: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(full), stored_hash)
