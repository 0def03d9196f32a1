"""User API token authentication: ``Authorization: Token <key>``, hashed and expiring (knox)."""

from __future__ import annotations

import binascii
from hmac import compare_digest

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connection
from django.utils import timezone
from knox.auth import TokenAuthentication
from knox.crypto import hash_token
from knox.models import get_token_model
from knox.settings import CONSTANTS, knox_settings
from rest_framework.authentication import get_authorization_header
from rest_framework.exceptions import AuthenticationFailed

from nodepool.api.permissions import remember_groups
from nodepool.auth_failures import record_failure, remember_good
from nodepool.db import from_row, prepared_cursor, select_list

# The schemes a user token is accepted under: knox's ``Token``, and ``Bearer`` (RFC 6750), which
# OAuth-minded clients and /metrics use; the same key either way (issue 33 item 10).
SCHEMES = (b"token", b"bearer")


class UserTokenAuthentication(TokenAuthentication):
    """django-rest-knox's token authentication, ``Authorization: Token <key>`` or its synonym
    ``Authorization: Bearer <key>`` (clients, the CLI, curl).

    Raises:
        AuthenticationFailed (401): unknown, expired or malformed token, or an inactive user.
    """

    def _cleanup_token(self, auth_token) -> bool:
        """Is ``auth_token`` expired? Expiry is inclusive: a token whose ``expiry`` is now is
        expired. Expired tokens are not deleted here (knox deletes them, and scans the user's
        others, on every request): their digests are kept ``NODEPOOL_EXPIRED_TOKEN_RETENTION_DAYS``
        so that presenting one answers ``token_expired`` rather than a generic refusal; the hourly
        ``nodepool.prune_expired_tokens`` task deletes them after that."""
        return auth_token.expiry is not None and auth_token.expiry <= timezone.now()

    def authenticate(self, request):
        """knox's ``authenticate`` (5.1) with ``Bearer`` accepted beside ``Token``. An accepted
        token is remembered by this process (``nodepool.auth_failures.remember_good``: it passes
        the failed-authentication gate of an address that others made fail)."""
        auth = get_authorization_header(request).split()
        if not auth or auth[0].lower() not in SCHEMES:
            return None  # another scheme (Node, Basic…) or none: another backend's
        if len(auth) == 1:
            raise AuthenticationFailed("Invalid token header. No credentials provided.")
        if len(auth) > 2:
            raise AuthenticationFailed("Invalid token header. Token string should not contain spaces.")
        # knox hashes whatever it is given; a key that is not ASCII cannot be one of ours.
        try:
            try:
                result = self.authenticate_credentials(auth[1])
            except UnicodeDecodeError:
                raise AuthenticationFailed("Invalid token.") from None
        except AuthenticationFailed:
            record_failure(request)  # counts against the client's address (nodepool.auth_failures)
            raise
        remember_good(request.META.get("HTTP_AUTHORIZATION", ""))
        return result

    def authenticate_credentials(self, token: bytes):
        """knox's own rule (``knox.auth.TokenAuthentication.authenticate_credentials``, 5.1): the
        tokens whose key is the token's first ``TOKEN_KEY_LENGTH`` characters, the first whose
        digest is the token's hash wins, an expired one is deleted and skipped. The tokens, their
        user and the user's roles are one prepared statement (:func:`_tokens_of_key`), not the
        ORM's ``select_related`` query plus a roles query: every API request authenticates, and
        building those queries cost more than running them.

        Returns ``(user, auth_token)``.

        Raises:
            AuthenticationFailed (401): no such token, a digest that does not match, an inactive
                user; an expired token (expiry at or before now) with reason ``token_expired``.
        """
        text = token.decode("utf-8")
        for auth_token in _tokens_of_key(text[: CONSTANTS.TOKEN_KEY_LENGTH]):
            try:
                digest = hash_token(text)
            except (TypeError, binascii.Error):
                raise AuthenticationFailed("Invalid token.") from None
            if compare_digest(digest, auth_token.digest):
                if self._cleanup_token(auth_token):
                    # 401 authentication_failed with reason token_expired (as node credentials
                    # say credential_expired): the client should sign in again, not retry.
                    raise AuthenticationFailed("The token has expired.", code="token_expired")
                if knox_settings.AUTO_REFRESH and auth_token.expiry:
                    self.renew_token(auth_token)
                return self.validate_user(auth_token)
        raise AuthenticationFailed("Invalid token.")


def _tokens_of_key(key: str) -> list:
    """knox's tokens whose ``token_key`` is ``key``, each with its ``user`` set and that user's
    group names remembered (``nodepool.api.permissions.remember_groups``): one prepared
    ``SELECT`` of token ⋈ user ⟕ groups, one row per token and group."""
    token_model, user_model = get_token_model(), get_user_model()
    membership = user_model._meta.get_field("groups").remote_field.through._meta
    quote = connection.ops.quote_name
    tokens, users, group = (
        quote(token_model._meta.db_table),
        quote(user_model._meta.db_table),
        quote(Group._meta.db_table),
    )
    members = quote(membership.db_table)
    sql = (
        f"SELECT {select_list(token_model)}, {select_list(user_model)}, {group}.{quote('name')} "  # noqa: S608 (names from the models)
        f"FROM {tokens} JOIN {users} ON {users}.{quote('id')} = {tokens}.{quote('user_id')} "
        f"LEFT JOIN {members} ON {members}.{quote(membership.get_field('user').column)} = {users}.{quote('id')} "
        f"LEFT JOIN {group} ON {group}.{quote('id')} = {members}.{quote(membership.get_field('group').column)} "
        f"WHERE {tokens}.{quote('token_key')} = %s"
    )
    with prepared_cursor() as cursor:
        cursor.execute(sql, [key])
        rows = cursor.fetchall()
    fields = token_model._meta.concrete_fields
    key_at, width = fields.index(token_model._meta.pk), len(fields)
    found: dict = {}
    for row in rows:
        auth_token = found.get(row[key_at])
        if auth_token is None:
            auth_token = found[row[key_at]] = from_row(token_model, row)
            auth_token.user = from_row(user_model, row[width:])
            remember_groups(auth_token.user, set())
        if row[-1] is not None:
            auth_token.user._nodepool_groups.add(row[-1])
    return list(found.values())
