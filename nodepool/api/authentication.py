"""User API token authentication: ``Authorization: Token <key>``, hashed and expiring (knox)."""

from __future__ import annotations

from django.utils import timezone
from knox.auth import TokenAuthentication


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
            from rest_framework.exceptions import AuthenticationFailed

            raise AuthenticationFailed("Invalid token.") from None
