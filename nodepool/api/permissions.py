"""Roles and permissions shared by all apps.

Roles are Django groups: ``operators`` (run the fleet), ``owners`` (marketplace contributors,
read-only on their own nodes), ``clients`` (schedulers and job systems asking for leases).
Superusers count as operators.
"""

from django.contrib.auth.models import Group
from django.db import connection
from rest_framework.permissions import BasePermission

from nodepool.db import prepared_cursor

OPERATORS, OWNERS, CLIENTS = "operators", "owners", "clients"
# Shared services that refuse stale writers (docs/leases.md): may validate any workload's fencing token.
FENCING_VALIDATORS = "fencing-validators"


def in_group(user, name: str) -> bool:
    """True when ``user`` is authenticated and a member of group ``name`` (cached per request)."""
    if not getattr(user, "is_authenticated", False):
        return False
    cache = getattr(user, "_nodepool_groups", None)
    if cache is None:
        cache = user._nodepool_groups = _group_names(user)
    return name in cache


def remember_groups(user, names: set[str]) -> None:
    """Record ``user``'s group names as read along with the user (token authentication does),
    so that :func:`in_group` asks no more."""
    user._nodepool_groups = names


def _group_names(user) -> set[str]:
    """``user``'s group names: ``user.groups.values_list("name")`` as one prepared statement,
    since every request of a client or owner asks."""
    quote = connection.ops.quote_name
    membership = user._meta.get_field("groups").remote_field.through._meta
    with prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT g.{quote('name')} FROM {quote(Group._meta.db_table)} g "  # noqa: S608 (names from the models)
            f"JOIN {quote(membership.db_table)} m ON m.{quote(membership.get_field('group').column)} = g.id "
            f"WHERE m.{quote(membership.get_field('user').column)} = %s",
            [user.pk],
        )
        return {row[0] for row in cursor.fetchall()}


def is_operator(user) -> bool:
    return bool(getattr(user, "is_superuser", False)) or in_group(user, OPERATORS)


def is_client(user) -> bool:
    return is_operator(user) or in_group(user, CLIENTS)


def is_owner(user) -> bool:
    return in_group(user, OWNERS)


def is_fencing_validator(user) -> bool:
    return in_group(user, FENCING_VALIDATORS)


def has_role(user) -> bool:
    """True for an authenticated user in at least one role (superusers count as operators)."""
    return is_operator(user) or any(in_group(user, role) for role in (OWNERS, CLIENTS, FENCING_VALIDATORS))


class HasRole(BasePermission):
    """The default permission: a signed-in user with a role. A user with no role gets 403 on every
    endpoint (never a 200 with an empty list); views narrow further with their own classes."""

    message = "Your account has no role (operators, owners, clients, fencing-validators); ask an operator."

    def has_permission(self, request, view):
        return has_role(request.user)


class IsOperator(BasePermission):
    message = "Only operators may do this."

    def has_permission(self, request, view):
        return is_operator(request.user)


class IsClientOrOperator(BasePermission):
    message = "Only lease clients and operators may do this."

    def has_permission(self, request, view):
        return is_client(request.user)


class IsOperatorOrReadOnlyOwner(BasePermission):
    """Operators do anything; owners and clients may only read (object scoping is the view's job)."""

    message = "Only operators may change this."

    def has_permission(self, request, view):
        if is_operator(request.user):
            return True
        return request.method in ("GET", "HEAD", "OPTIONS") and (is_owner(request.user) or is_client(request.user))
