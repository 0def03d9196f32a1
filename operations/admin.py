"""Admin for pool operations: upgrades with start/pause/resume/rollback/abort actions (each checks
the version the operator saw), pool operation settings, decisions, machines, preemptions."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join

from fleet.events import Actor
from maintenance.admin import ReasonForm, Spec, run_with_form
from nodepool.api.problems import Problem

from . import disruption, repair, replacement_sweep, services, upgrades
from .demand import fallback_pool_names
from .models import PoolOperations, Preemption, ProviderMachine, Repair, ScaleDecision, Upgrade, UpgradeNode


class UpgradeNodeInline(admin.TabularInline):
    model = UpgradeNode
    extra = 0
    can_delete = False
    fields = ["phase", "position", "node", "state", "from_version", "started_at", "finished_at", "detail"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


def _action(service, label: str):
    """An admin action running ``service`` on the selected upgrades after an intermediate form
    (maintenance.admin.run_with_form): the operator gives a reason, and each upgrade is acted on
    at the version that form showed; a change since then is refused (412), not acted on blindly."""

    def run(upgrade, version, actor, data):
        service(upgrade_id=upgrade.pk, expected_version=version, actor=actor, reason=data["reason"])

    spec = Spec(label.capitalize(), "operations.operate_upgrade", ReasonForm, run)

    def act(modeladmin, request, queryset):
        return run_with_form(modeladmin, request, queryset, spec, lambda upgrade: upgrade.version)

    act.short_description = f"{label.capitalize()} selected upgrades…"
    act.__name__ = f"upgrade_{label.replace(' ', '_')}"
    act.allowed_permissions = ("operate",)
    return act


@admin.register(Upgrade)
class UpgradeAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "pool",
        "state",
        "target_version",
        "max_unavailable_nodes",
        "failures",
        "created_at",
        "version",
    ]
    list_filter = ["state", "pool"]
    inlines = [UpgradeNodeInline]
    actions = [
        _action(upgrades.upgrade_start, "start"),
        _action(upgrades.upgrade_pause, "pause"),
        _action(upgrades.upgrade_resume, "resume"),
        _action(upgrades.upgrade_rollback, "roll back"),
        _action(upgrades.upgrade_abort, "abort"),
    ]
    readonly_fields = [f.name for f in Upgrade._meta.fields]

    @admin.display(description="target")
    def target_version(self, obj: Upgrade) -> str:
        return obj.target.get("version", "")

    def has_operate_permission(self, request) -> bool:
        return request.user.has_perm("operations.operate_upgrade")

    def has_add_permission(self, request) -> bool:
        return False  # created through the API (validated target); acted on here

    def has_change_permission(self, request, obj=None) -> bool:
        return obj is None and request.user.has_perm("operations.operate_upgrade")


class PoolOperationsAdminForm(forms.ModelForm):
    """Pool operation settings, changed through the API's service (services.pool_operations_update):
    the same validation, the spot taint added or removed with ``spot``, an event, and the version
    the operator saw checked (412 in the API, a form error here)."""

    expected_version = forms.IntegerField(widget=forms.HiddenInput, required=False)
    provider_secret = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Leave empty to keep the current secret.",
    )

    class Meta:
        model = PoolOperations
        fields = [
            "spot", "fallback_pool", "drain_policy", "drain_timeout", "provider", "provider_url", "provider_secret",
            "min_nodes", "max_nodes", "node_template", "scale_up_delay", "scale_up_cooldown",
            "max_nodes_per_scale_up", "scale_down_utilization", "scale_down_after", "scale_down_cooldown",
            "boot_timeout", "max_launches_in_flight", "scale_up_backoff_base", "scale_up_backoff_max",
            "disruption_budgets", "consolidate_after", "consolidation_min_saving", "expire_after",
            "termination_grace",
            "repair_rules", "repair_max_unhealthy", "repair_max_concurrent",
        ]  # fmt: skip

    fallback_pools = forms.CharField(
        required=False,
        help_text="Pool names, comma-separated, in the order to try while this pool backs off.",
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields["expected_version"].initial = self.instance.version
            self.initial["fallback_pools"] = ", ".join(fallback_pool_names(self.instance))

    def wire_changes(self) -> dict:
        """The changed fields as a ``PATCH /pools/{name}/operations`` body."""
        body = {}
        for name in self.changed_data:
            value = self.cleaned_data.get(name)
            if name == "expected_version" or (name == "provider_secret" and not value):
                continue
            if name == "fallback_pool":
                value = value.name if value is not None else None
            elif name == "node_template":
                value = _wire_template(value)
            elif name == "fallback_pools":
                value = [part.strip() for part in (value or "").split(",") if part.strip()]
            body[name] = value
        return body

    def clean(self):
        data = super().clean()
        if self.errors or not self.instance.pk:
            return data
        try:
            services.parse_changes(self.wire_changes(), self.instance.pool)
        except Problem as exc:
            field = ((exc.extra or {}).get("errors") or [{}])[0].get("field")
            self.add_error(field if field in self.fields else None, str(exc.detail))
            return data
        current = PoolOperations.objects.filter(pk=self.instance.pk).values_list("version", flat=True).first()
        if data.get("expected_version") != current:
            raise forms.ValidationError(
                f"Someone changed these settings meanwhile (now version {current}); reload the page and try again."
            )
        return data


def _wire_template(template) -> dict:
    """A stored (canonical) node template as the API takes it: cpu in millicores is sent as "<n>m"."""
    template = dict(template or {})
    resources = template.get("resources") or {}
    template["resources"] = {
        name: (f"{value}m" if name == "cpu" else str(value)) if isinstance(value, int) else value
        for name, value in resources.items()
    }
    return template


def _window(budget: dict) -> str:
    """When a budget applies: always, or its schedule with the current or next window."""
    if not budget.get("schedule"):
        return "always"
    when = f"{budget['schedule']} for {budget['duration']} ({budget.get('timezone', 'UTC')})"
    if budget["active"]:
        return f"{when}, active until {budget['window_end']}"
    return f"{when}, next from {budget['window_start']}"


@admin.register(PoolOperations)
class PoolOperationsAdmin(admin.ModelAdmin):
    form = PoolOperationsAdminForm
    list_display = ["pool", "spot", "fallback_pool", "provider", "min_nodes", "max_nodes", "version"]
    readonly_fields = [
        "pool", "target", "disruptions", "drift_and_expiry", "repairs", "consecutive_failures", "backoff_until",
        "last_scale_up_at", "last_scale_down_at", "underused_since", "version",
    ]  # fmt: skip

    def has_add_permission(self, request) -> bool:
        return False  # every pool has its settings row (operations.upgrade_plan.pool_operations)

    @admin.display(description="Disruptions now")
    def disruptions(self, obj: PoolOperations) -> str:
        """The budgets with their windows, the disruptions allowed per reason, and the blocked nodes
        (operations.disruption.pool_status, what nodepoolctl describe pool shows)."""
        status = disruption.pool_status(obj.pool)
        budgets = format_html_join(
            "",
            "<li>#{}: nodes {} (= {}), {}, {}</li>",
            (
                (b["index"], b["nodes"], b["limit"], ", ".join(b.get("reasons") or []) or "all reasons", _window(b))
                for b in status["budgets"]
            ),
        )
        allowed = ", ".join(f"{reason}: {n}" for reason, n in status["allowed_disruptions"].items())
        blocked = format_html_join(
            "", "<li>{} ({}): {}</li>", ((b["node"], b["reason"], b["detail"]) for b in status["blocked"])
        )
        return format_html(
            "<p>{} node(s), {} disrupting</p><p>Budgets:</p><ul>{}</ul><p>Allowed now: {}</p>"
            "<p>Blocked disruptions:</p><ul>{}</ul>",
            status["members"],
            status["disrupting"],
            budgets or "none",
            allowed,
            blocked or format_html("<li>{}</li>", "none"),
        )

    @admin.display(description="Drift and expiry")
    def drift_and_expiry(self, obj: PoolOperations) -> str:
        """The pool's shape hash, drifted and expired nodes, and its replacements
        (operations.replacement_sweep.pool_status, what nodepoolctl describe pool shows)."""
        status = replacement_sweep.pool_status(obj.pool, recent=10)
        drifted = format_html_join(
            "",
            "<li>{}: {} ({})</li>",
            ((d["node"], d["condition"]["reason"], d["condition"]["message"]) for d in status["drifted"]),
        )
        rows = format_html_join(
            "",
            "<li>{} ({}): {}{}: {}</li>",
            (
                (r["node"], r["reason"], r["state"], " (forced)" if r["forced"] else "", r["detail"])
                for r in status["replacements"]
            ),
        )
        none = format_html("<li>{}</li>", "none")
        return format_html(
            "<p>Shape hash {}; {} expired node(s){}</p><p>Drifted nodes:</p><ul>{}</ul><p>Replacements:</p><ul>{}</ul>",
            status["shape_hash"][:12],
            len(status["expired"]),
            f"; expiry stands still: {status['guard']}" if status["guard"] else "",
            drifted or none,
            rows or none,
        )

    @admin.display(description="Repairs now")
    def repairs(self, obj: PoolOperations) -> str:
        """The repair breaker (open or closed, and why), the outage guard and the repairs in progress
        (operations.repair.pool_status, what nodepoolctl describe pool shows)."""
        status = repair.pool_status(obj.pool)
        breaker = status["breaker"]
        state = (
            format_html("<strong>open</strong> since {}: {}", breaker["since"], breaker["detail"])
            if breaker["open"]
            else "closed"
        )
        in_progress = format_html_join(
            "",
            "<li>{} {} ({}): {}</li>",
            ((r["node"], r["action"], r["state"], r["condition"]) for r in status["in_progress"]),
        )
        return format_html(
            "<p>Breaker: {} ({} of {} nodes unhealthy; opens above {:.0%})</p><p>Outage guard: {}</p>"
            "<p>In progress (at most {}):</p><ul>{}</ul>"
            "<p>A <em>quarantine</em> rule revokes the node's credential: the node comes back only when a "
            "person releases it.</p>",
            state,
            status["unhealthy"],
            status["members"],
            status["max_unhealthy"],
            status["guard"] or "not engaged",
            status["max_concurrent"],
            in_progress or format_html("<li>{}</li>", "none"),
        )

    def save_model(self, request, obj, form, change):
        try:
            updated = services.pool_operations_update(
                pool=obj.pool,
                expected_version=form.cleaned_data["expected_version"],
                data=form.wire_changes(),
                actor=Actor.from_request(request),
            )
        except Problem as exc:  # a change between clean() and here (the row lock decides)
            self.message_user(request, str(exc.detail), messages.ERROR)
            return
        obj.version = updated.version


@admin.register(Repair)
class RepairAdmin(admin.ModelAdmin):
    list_display = ["created_at", "pool", "node", "action", "state", "condition", "finished_at"]
    list_filter = ["state", "action", "pool"]
    readonly_fields = [f.name for f in Repair._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False  # started by the repair sweep from the pool's rules

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ScaleDecision)
class ScaleDecisionAdmin(admin.ModelAdmin):
    list_display = ["created_at", "pool", "direction", "outcome", "count", "reason", "attempts"]
    list_filter = ["direction", "outcome", "pool"]
    readonly_fields = [f.name for f in ScaleDecision._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ProviderMachine)
class ProviderMachineAdmin(admin.ModelAdmin):
    list_display = ["name", "pool", "provider", "state", "node", "requested_at", "ready_at"]
    list_filter = ["state", "provider", "pool"]
    readonly_fields = [f.name for f in ProviderMachine._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Preemption)
class PreemptionAdmin(admin.ModelAdmin):
    list_display = ["node", "pool", "source", "deadline", "received_at", "state", "leases_requeued"]
    list_filter = ["state", "source", "pool"]
    readonly_fields = [f.name for f in Preemption._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
