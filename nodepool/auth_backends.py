"""Login lockout (django-axes) for every login form: the admin's and the browsable API's, and the
per-account ceiling across addresses (nodepool.auth_failures; docs/foundation.md)."""

from __future__ import annotations

import contextlib
import math

from axes.backends import AxesStandaloneBackend
from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_login_failed
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.dispatch import receiver

from nodepool.api.throttling import client_address

from . import auth_failures


def _username(username, kwargs) -> str:
    return str(username or kwargs.get(get_user_model().USERNAME_FIELD) or "")


class LoginLockoutBackend(AxesStandaloneBackend):
    """django-axes' lockout check, first in ``AUTHENTICATION_BACKENDS``, then the per-account
    ceiling.

    A login form always passes the request (Django's ``LoginView``, which both the admin and
    ``/api-auth/login/`` use), so lockout applies there. A call without a request comes from code,
    not from the network (``Client.login`` in tests, a shell): axes would refuse it outright, so
    it is left to the next backend instead.

    Raises:
        AxesBackendPermissionDenied: this username is locked out from this address (axes).
        PermissionDenied: the account is past its ceiling of failures across addresses and this
            address is not familiar (``nodepool.auth_failures.account_wait``); the password is
            not checked, the answer is axes' lockout page (429) with ``Retry-After``.
    """

    def authenticate(self, request=None, username=None, password=None, **kwargs):
        if request is None:
            return None
        super().authenticate(request, username=username, password=password, **kwargs)
        name = _username(username, kwargs)
        wait = auth_failures.account_wait(name, client_address(request))
        if wait is not None:
            request.nodepool_login_retry_after = math.ceil(wait)
            request.axes_locked_out = True  # axes' middleware answers its lockout page (429)
            raise PermissionDenied("This account is refusing logins from unfamiliar addresses for now.")
        return None


@receiver(user_login_failed, dispatch_uid="nodepool.count_login_failure")
def count_login_failure(sender, credentials, request=None, **kwargs):
    """Every failed login from the network adds to its account's counter, except one the ceiling
    itself refused (the window is not prolonged by refused attempts)."""
    if request is None or getattr(request, "nodepool_login_retry_after", None):
        return
    name = _username(credentials.get("username"), credentials)
    # The login already failed; if the database cannot count it, the per-address lockout still stands.
    with contextlib.suppress(DatabaseError):
        auth_failures.count_login_failure(name)


class LoginRetryAfterMiddleware:
    """Just outside axes' middleware: the lockout page of the per-account ceiling carries
    ``Retry-After`` (seconds until the account's window ends)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        wait = getattr(request, "nodepool_login_retry_after", None)
        if wait and response.status_code == 429:
            response["Retry-After"] = str(wait)
        return response
