"""Fleet admin: pools, nodes (with admission checks, inventory, credentials and events inline),
bootstrap tokens (secret shown once). Operators manage; marketplace owners get a read-only view
of their own nodes and nothing else. Every change goes through :mod:`fleet.services`.
"""

from __future__ import annotations

import uuid

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import Count, F, OuterRef, Q, Subquery
from django.template.response import TemplateResponse
from django.utils import timezone

from nodepool.api.permissions import is_operator, is_owner
from nodepool.api.problems import Problem

from . import services
from .capability import CapabilityError, parse_labels, parse_taints
from .events import Actor
from .models import AdmissionCheck, BootstrapToken, Node, NodeCredential, NodeEvent, NodeResource, Pool
from .policy import check_pool, parse_required_capabilities, parse_required_labels, parse_reservations, parse_specifier

RECENT_EVENTS_INLINE = 50


class OperatorOnlyAdmin(admin.ModelAdmin):
    """Visible to operators only (superusers or the ``operators`` group)."""

    def has_module_permission(self, request):
        return is_operator(request.user)

    def has_view_permission(self, request, obj=None):
        return is_operator(request.user)

    def has_add_permission(self, request):
        return is_operator(request.user)

    def has_change_permission(self, request, obj=None):
        return is_operator(request.user)

    def has_delete_permission(self, request, obj=None):
        return is_operator(request.user)


# --- pools ------------------------------------------------------------------------------------------------


class PoolAdminForm(forms.ModelForm):
    """Reservations and required capabilities accept quantities ("500m", "1Gi"); the version is checked."""

    expected_version = forms.IntegerField(widget=forms.HiddenInput, required=False)
    parsers = {
        "labels": parse_labels,
        "taints": parse_taints,
        "reservations": parse_reservations,
        "required_capabilities": parse_required_capabilities,
        "required_labels": parse_required_labels,
        "allowed_agent_versions": parse_specifier,
    }

    class Meta:
        model = Pool
        fields = [
            "name", "description", "kind", "labels", "taints", "reservations", "admission_mode",
            "allowed_agent_versions", "required_capabilities", "required_labels", "benchmark_required",
            "benchmark_tolerance", "benchmark_timeout", "attestation_required", "attestation_public_key",
            "trust_node_labels", "heartbeat_interval", "heartbeat_grace", "loss_threshold", "unhealthy_conditions",
            "degraded_conditions", "scheduling_policy",
        ]  # fmt: skip

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields["expected_version"].initial = self.instance.version

    def clean(self):
        data = super().clean()
        for name, parse in self.parsers.items():
            if name in data:
                try:
                    data[name] = parse(data[name], field=name)
                except CapabilityError as exc:
                    self.add_error(name, exc.message)
        if self.errors:
            return data
        values = {f.attname: getattr(self.instance, f.attname) for f in Pool._meta.concrete_fields}
        values.update({k: v for k, v in data.items() if k in values})
        try:
            check_pool(values)
        except CapabilityError as exc:
            self.add_error(exc.field if exc.field in self.fields else None, exc.message)
        if self.instance.pk:
            current = Pool.objects.filter(pk=self.instance.pk).values_list("version", flat=True).first()
            if data.get("expected_version") != current:
                raise forms.ValidationError(
                    f"Someone changed this pool meanwhile (now version {current}); reload the page and try again."
                )
        return data


@admin.register(Pool)
class PoolAdmin(OperatorOnlyAdmin):
    form = PoolAdminForm
    list_display = ["name", "kind", "admission_mode", "benchmark_required", "node_count", "scheduling_policy"]
    list_filter = ["kind", "admission_mode"]
    search_fields = ["name", "description"]
    readonly_fields = ["version", "created_at", "updated_at"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(node_count=Count("nodes"))

    @admin.display(ordering="node_count")
    def node_count(self, pool):
        return pool.node_count

    def save_model(self, request, obj, form, change):
        if not change:
            obj.save()
            return
        changes = {name: form.cleaned_data[name] for name in form.changed_data if name != "expected_version"}
        updated = services.pool_update(
            pool_id=obj.pk,
            expected_version=form.cleaned_data["expected_version"],
            changes=changes,
            actor=Actor.from_request(request),
        )
        obj.version = updated.version


# --- bootstrap tokens -----------------------------------------------------------------------------------------


class BootstrapTokenAdminForm(forms.ModelForm):
    class Meta:
        model = BootstrapToken
        fields = ["pool", "description", "expires_at", "max_uses", "owner"]

    def clean(self):
        data = super().clean()
        if not self.instance.pk and data.get("pool") and data.get("expires_at") and data.get("max_uses"):
            try:
                services.bootstrap_token_validate(
                    pool=data["pool"], expires_at=data["expires_at"], max_uses=data["max_uses"], owner=data.get("owner")
                )
            except Problem as exc:
                raise forms.ValidationError(str(exc.detail)) from exc
        return data


@admin.register(BootstrapToken)
class BootstrapTokenAdmin(OperatorOnlyAdmin):
    form = BootstrapTokenAdminForm
    list_display = ["prefix", "pool", "description", "uses", "max_uses", "expires_at", "revoked_at", "owner"]
    list_filter = ["pool"]
    search_fields = ["prefix", "description"]
    actions = ["revoke_tokens"]

    def get_changeform_initial_data(self, request):
        return {"expires_at": timezone.now() + timezone.timedelta(days=1), "max_uses": 1}

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ["prefix", "uses", "revoked_at", "created_by"]
        return ["pool", "prefix", "expires_at", "max_uses", "uses", "owner", "created_by", "created_at", "revoked_at"]

    def save_model(self, request, obj, form, change):
        if change:
            obj.save(update_fields=["description"])
            return
        token, secret = services.bootstrap_token_create(
            pool=obj.pool,
            expires_at=obj.expires_at,
            max_uses=obj.max_uses,
            description=obj.description,
            owner=obj.owner,
            created_by=request.user,
        )
        obj.pk, obj.prefix, obj.secret_hash = token.pk, token.prefix, token.secret_hash
        obj._state.adding = False
        # Shown once: the secret is never stored, only its hash.
        messages.warning(request, f"Bootstrap token (copy it now, it will not be shown again): {secret}")

    @admin.action(description="Revoke selected bootstrap tokens")
    def revoke_tokens(self, request, queryset):
        for token in queryset:
            services.bootstrap_token_revoke(token_id=token.pk)
        self.message_user(request, f"Revoked {queryset.count()} token(s).")


# --- nodes ------------------------------------------------------------------------------------------------------


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = False

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_view_permission(self, request, obj=None):
        return True

    def get_readonly_fields(self, request, obj=None):
        return self.fields


class AdmissionCheckInline(ReadOnlyInline):
    model = AdmissionCheck
    fields = ["attempt", "name", "status", "detail", "started_at", "finished_at"]
    ordering = ["-attempt", "id"]


class NodeResourceInline(ReadOnlyInline):
    model = NodeResource
    fields = ["name", "capacity", "reserved", "allocatable", "allocated"]


class NodeCredentialInline(ReadOnlyInline):
    model = NodeCredential
    fields = ["prefix", "issuer", "agent_version", "issued_at", "expires_at", "rotated_at", "revoked_at"]


class NodeEventInline(ReadOnlyInline):
    model = NodeEvent
    fields = ["created_at", "type", "from_state", "to_state", "actor_type", "actor_name", "reason"]
    ordering = ["-created_at", "-id"]

    def get_queryset(self, request):
        # The most recent events only: a node's history can be long, the page must not be.
        recent = NodeEvent.objects.filter(node=OuterRef("node")).order_by("-created_at", "-id")
        cutoff = Subquery(recent.values("created_at")[RECENT_EVENTS_INLINE - 1 : RECENT_EVENTS_INLINE])
        qs = super().get_queryset(request).annotate(cutoff=cutoff)
        return qs.filter(Q(cutoff__isnull=True) | Q(created_at__gte=F("cutoff")))


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    """Operators: everything read-only plus the Admit action. Owners: their own nodes, read-only."""

    list_display = ["__str__", "id", "pool", "owner", "lifecycle", "liveness", "ready", "health", "version"]
    list_filter = ["pool", "lifecycle", "liveness", "owner"]
    search_fields = ["hostname", "display_name"]
    list_select_related = ["pool", "owner"]
    actions = ["admit_nodes"]
    inlines = [AdmissionCheckInline, NodeResourceInline, NodeCredentialInline, NodeEventInline]

    def get_queryset(self, request):
        qs = super().get_queryset(request).select_related("pool", "owner")
        return qs if is_operator(request.user) else qs.filter(owner=request.user)

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Node._meta.fields]

    def get_inline_instances(self, request, obj=None):
        inlines = super().get_inline_instances(request, obj)
        if is_operator(request.user):
            return inlines
        return [i for i in inlines if not isinstance(i, NodeCredentialInline)]

    def get_list_filter(self, request):
        return self.list_filter if is_operator(request.user) else ["lifecycle", "liveness"]

    def get_search_results(self, request, queryset, search_term):
        """Search also by node id (a UUID) and by label (``key=value`` on platform or node labels)."""
        term = search_term.strip()
        try:
            return queryset.filter(pk=uuid.UUID(term)), False
        except ValueError:
            pass
        key, eq, value = term.partition("=")
        if eq and key:
            from .filtersets import _label_filter

            try:
                platform = _label_filter(queryset, "labels", [term])
                declared = _label_filter(queryset, "node_labels", [term])
            except Problem:
                return queryset.none(), False
            return (platform | declared).distinct(), True
        return super().get_search_results(request, queryset, search_term)

    def has_module_permission(self, request):
        return is_operator(request.user) or is_owner(request.user)

    def has_view_permission(self, request, obj=None):
        if is_operator(request.user):
            return True
        return is_owner(request.user) and (obj is None or obj.owner_id == request.user.pk)

    def has_add_permission(self, request):
        return False  # nodes enroll themselves with a bootstrap token

    def has_change_permission(self, request, obj=None):
        return False  # state changes are actions (admit here; cordon, drain... in maintenance)

    def has_delete_permission(self, request, obj=None):
        return False  # nodes are retired, never deleted: identity and history stay

    def has_admit_permission(self, request):
        return is_operator(request.user)

    @admin.action(description="Admit selected nodes (run admission checks)", permissions=["admit"])
    def admit_nodes(self, request, queryset):
        """Two steps: a confirmation page records the version of each node as shown, then admission
        runs against exactly those versions, so a node changed in between is refused (412), not admitted."""
        if request.POST.get("confirm") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "title": "Admit nodes",
                "opts": self.model._meta,
                "nodes": list(queryset),
                "action_checkbox_name": ACTION_CHECKBOX_NAME,
                "action": "admit_nodes",
            }
            return TemplateResponse(request, "admin/fleet/node/admit_confirmation.html", context)
        actor = Actor.from_request(request)
        reason = request.POST.get("reason", "")[:1000]
        admitted = 0
        for node in queryset:
            try:
                expected = int(request.POST.get(f"version_{node.pk}", ""))
                services.node_admit(node_id=node.pk, expected_version=expected, actor=actor, reason=reason)
                admitted += 1
            except ValueError:
                self.message_user(request, f"{node}: no version was confirmed.", messages.ERROR)
            except Problem as exc:
                self.message_user(request, f"{node}: {exc.detail}", messages.ERROR)
        if admitted:
            self.message_user(request, f"Admission started for {admitted} node(s).", messages.SUCCESS)
        return None
