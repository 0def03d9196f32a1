"""The admin's users page with a "log out everywhere" action (issue 30, item 6)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin

from nodepool.tokens import log_out_everywhere

User = get_user_model()


@admin.action(description="Log out everywhere (revoke API tokens, end sessions)")
def log_out_everywhere_action(modeladmin, request, queryset):
    """Revoke every API token and end every session of each selected user."""
    tokens = sessions = 0
    for user in queryset:
        done = log_out_everywhere(user)
        tokens, sessions = tokens + done["tokens_revoked"], sessions + done["sessions_ended"]
    modeladmin.message_user(
        request,
        f"Logged {queryset.count()} user(s) out everywhere: "
        f"{tokens} API token(s) revoked, {sessions} session(s) ended.",
        messages.SUCCESS,
    )


if admin.site.is_registered(User):
    base = type(admin.site._registry[User])
    admin.site.unregister(User)
else:  # pragma: no cover - django.contrib.auth always registers it first
    base = UserAdmin


@admin.register(User)
class NodepoolUserAdmin(base):
    actions = [*(base.actions or []), log_out_everywhere_action]
