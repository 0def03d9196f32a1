"""Login lockout (django-axes) for every login form: the admin's and the browsable API's."""

from __future__ import annotations

from axes.backends import AxesStandaloneBackend


class LoginLockoutBackend(AxesStandaloneBackend):
    """django-axes' lockout check, first in ``AUTHENTICATION_BACKENDS``.

    A login form always passes the request (Django's ``LoginView``, which both the admin and
    ``/api-auth/login/`` use), so lockout applies there. A call without a request comes from code,
    not from the network (``Client.login`` in tests, a shell): axes would refuse it outright, so
    it is left to the next backend instead.
    """

    def authenticate(self, request=None, username=None, password=None, **kwargs):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)
