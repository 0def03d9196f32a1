"""Admin behaviour shared by every app: audit records are append-only.

An audit record (a drain, an eviction, a quarantine, an event, a lease, an admission check, a
consistency report, a credential…) is never deleted from the admin: deleting one breaks state
(a node left ``draining`` with no drain to cancel) and loses history. Credentials and tokens are
revoked instead. Records nobody may edit are shown read-only, without Save buttons.
"""

from __future__ import annotations


class AppendOnlyAdminMixin:
    """No delete: neither the delete button nor the "delete selected" action."""

    def has_delete_permission(self, request, obj=None):
        return False


class ReadOnlyRecordAdminMixin(AppendOnlyAdminMixin):
    """Append-only and read-only: the change page is a view page (no Save buttons); the model's
    own admin actions (cancel a drain, revoke a lease…) still act through services."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False
