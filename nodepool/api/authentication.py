"""User API token authentication: ``Authorization: Token <key>``, hashed and expiring (knox)."""

from __future__ import annotations

import binascii
from hmac import compare_digest

from django.contrib.auth import get_user_model
from django.utils import timezone
from knox.auth import TokenAuthentication
from knox.crypto import hash_token
from knox.models import get_token_model
from knox.settings import CONSTANTS, knox_settings
from rest_framework.exceptions import AuthenticationFailed

from nodepool.db import fetch_rows


class UserTokenAuthentication(TokenAuthentication):
    """django-rest-knox's token authentication, keyword ``Token`` (clients, the CLI, curl).

    Raises:
        AuthenticationFailed (401): unknown, expired or malformed token, or an inactive user.
    """

    def _cleanup_token(self, auth_token) -> bool:
        """Is ``auth_token`` expired (then deleted)? knox also scans and deletes the user's other
        expired tokens here, one more query on every request; nodepool leaves that to the hourly
        ``nodepool.prune_expired_tokens`` task."""
        if auth_token.expiry is not None and auth_token.expiry < timezone.now():
            auth_token.delete()
            return True
        return False

    def authenticate(self, request):
        # knox hashes whatever it is given; a key that is not ASCII cannot be one of ours.
        try:
            return super().authenticate(request)
        except UnicodeDecodeError:
            raise AuthenticationFailed("Invalid token.") from None

    def authenticate_credentials(self, token: bytes):
        """knox's own rule (``knox.auth.TokenAuthentication.authenticate_credentials``, 5.1): the
        tokens whose key is the token's first ``TOKEN_KEY_LENGTH`` characters, the first whose
        digest is the token's hash wins, an expired one is deleted and skipped. Its rows and
        their user are read by prepared statements (``nodepool.db.fetch_rows``), not by the ORM's
        ``select_related`` query: every API request authenticates, and building that query cost
        more than running it.

        Returns ``(user, auth_token)``.

        Raises:
            AuthenticationFailed (401): no such token, a digest that does not match, an expired
                token, an inactive or deleted user.
        """
        text = token.decode("utf-8")
        for auth_token in fetch_rows(get_token_model(), "token_key", text[: CONSTANTS.TOKEN_KEY_LENGTH]):
            if self._cleanup_token(auth_token):
                continue
            try:
                digest = hash_token(text)
            except (TypeError, binascii.Error):
                raise AuthenticationFailed("Invalid token.") from None
            if compare_digest(digest, auth_token.digest):
                users = fetch_rows(get_user_model(), "id", auth_token.user_id, limit=1)
                if not users:
                    raise AuthenticationFailed("User inactive or deleted.")
                auth_token.user = users[0]
                if knox_settings.AUTO_REFRESH and auth_token.expiry:
                    self.renew_token(auth_token)
                return self.validate_user(auth_token)
        raise AuthenticationFailed("Invalid token.")
