"""What the marketplace's admin pages share: the base of the pages owners and operators read, and
a link to another admin page."""

from __future__ import annotations

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from nodepool.admin_mixins import ReadOnlyRecordAdminMixin
from nodepool.api.permissions import is_operator, is_owner


def link(viewname: str, pk, label) -> str:
    return format_html('<a href="{}">{}</a>', reverse(viewname, args=[pk]), label)


class ReadOnlyForOwners(ReadOnlyRecordAdminMixin, admin.ModelAdmin):
    """Operators and owners read; nobody adds, edits or deletes here (services do).

    ``owner_field`` is the lookup from a row to its owner (``"owner"``, or ``"node__owner"`` for rows
    an owner sees because they ran on the owner's node). Nodes and pools are shown as text, not
    links: owners cannot open the fleet's pages.
    """

    owner_field = "owner"

    def has_module_permission(self, request):
        return is_operator(request.user) or is_owner(request.user)

    def has_view_permission(self, request, obj=None):
        if is_operator(request.user):
            return True
        return is_owner(request.user) and (obj is None or self.owner_of(obj) == request.user.pk)

    def owner_of(self, obj):
        *path, owner = self.owner_field.split("__")
        for name in path:
            obj = getattr(obj, name)
        return getattr(obj, f"{owner}_id")

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        if is_operator(request.user):
            return qs
        return qs.filter(**{self.owner_field: request.user}) if is_owner(request.user) else qs.none()

    def get_actions(self, request):
        return super().get_actions(request) if is_operator(request.user) else {}

    def get_list_filter(self, request):
        return self.list_filter if is_operator(request.user) else [f for f in self.list_filter if f != "owner"]

    @admin.display(description="node")
    def node_text(self, obj):
        return str(obj.node)

    @admin.display(description="pool")
    def pool_text(self, obj):
        return obj.pool.name
