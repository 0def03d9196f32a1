"""Fleet admin: the operator-only base class, and the pool and bootstrap-token pages (split from
fleet.admin, issue 28 step 8; fleet.admin imports this module, which registers them)."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.db.models import Count
from django.utils import timezone

from nodepool.admin_mixins import AppendOnlyAdminMixin
from nodepool.api.permissions import is_operator
from nodepool.api.problems import Problem

from . import (
    admin_reliability,  # noqa: F401  (registers the node page's Reliability section)
    services,
)
from .capability import CapabilityError, parse_labels, parse_taints
from .events import Actor
from .models import BootstrapToken, Pool
from .policy import check_pool, parse_required_capabilities, parse_required_labels, parse_reservations, parse_specifier


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
            "degraded_conditions", "allowed_undeclared_resources", "scheduling_policy", "reverification_period",
            "reverification_window", "reverification_tolerance_percent", "reverification_busy_policy",
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
class BootstrapTokenAdmin(AppendOnlyAdminMixin, OperatorOnlyAdmin):
    """Tokens are revoked (an action), never deleted: the nodes they enrolled name them."""

    form = BootstrapTokenAdminForm
    list_display = ["prefix", "pool", "node", "description", "uses", "max_uses", "expires_at", "revoked_at", "owner"]
    list_filter = ["pool"]
    search_fields = ["prefix", "description"]
    actions = ["revoke_tokens"]

    def get_changeform_initial_data(self, request):
        return {"expires_at": timezone.now() + timezone.timedelta(days=1), "max_uses": 1}

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ["prefix", "node", "uses", "revoked_at", "created_by"]
        return [
            "pool", "node", "prefix", "expires_at", "max_uses", "uses", "owner", "created_by", "created_at",
            "revoked_at",
        ]  # fmt: skip

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
