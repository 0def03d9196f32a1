"""Log out everywhere (issue 30, item 6): a user revokes all of their API tokens and ends their
sessions; an operator does it for any user (also an admin action on users, nodepool.admin)."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from nodepool.api.errors import USER_NOT_FOUND
from nodepool.api.permissions import IsOperator
from nodepool.api.problems import NotFound
from nodepool.api.strict import refuse_unknown_members
from nodepool.tokens import log_out_everywhere

LOGGED_OUT = inline_serializer(
    "LoggedOutEverywhere",
    {
        "username": serializers.CharField(),
        "tokens_revoked": serializers.IntegerField(help_text="API tokens deleted (they are refused from now on)."),
        "sessions_ended": serializers.IntegerField(help_text="Admin / browsable-API sessions ended."),
    },
)


def _answer(user) -> Response:
    return Response({"username": user.get_username(), **log_out_everywhere(user)})


class LogoutEverywhere(APIView):
    """``POST /api/v1/auth/logout-everywhere`` (empty body; any user with a role, as every
    endpoint): the caller's every API token — the one this request used included — is revoked
    and every session of theirs ended.

    Raises:
        Problem 400 ``unknown_field`` / ``malformed_body``: a body with members (nothing changed).
        401: no user credential; 403: a node credential (it has no user) or a user without a role.
    """

    @extend_schema(request=None, responses=LOGGED_OUT)
    def post(self, request):
        refuse_unknown_members(request.data, ())
        return _answer(request.user)


class UserLogoutEverywhere(APIView):
    """``POST /api/v1/users/{username}/logout-everywhere`` (operators, empty body): the same for
    any user, e.g. after a leaked token or a departure.

    Raises:
        Problem 404 ``user_not_found``: no such username; 400 as above; 403 for non-operators.
    """

    permission_classes = [IsOperator]

    @extend_schema(request=None, responses=LOGGED_OUT)
    def post(self, request, username: str):
        refuse_unknown_members(request.data, ())
        model = get_user_model()
        try:
            user = model.objects.get_by_natural_key(username)
        except model.DoesNotExist:
            raise NotFound(f"No user named {username!r}.", USER_NOT_FOUND) from None
        return _answer(user)
