"""Admin pages of the money (docs/marketplace.md, "Pool periods", "Payouts"): operators read pool
periods and work the queues of mismatch items, payouts, payout holds and line appeals with actions
that take a reason (marking a payout paid takes the external reference, correcting a line appeal
its amount); owners read their own payouts, holds and line appeals, each page with its history
(the events of that payout, hold or appeal)."""

from __future__ import annotations

from decimal import Decimal

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from fleet.admin import OperatorOnlyAdmin
from fleet.events import Actor
from fleet.models import NodeEvent
from maintenance.admin import ReasonForm, Spec, run_with_form
from nodepool.admin_mixins import ReadOnlyRecordAdminMixin
from nodepool.api.permissions import is_operator, is_owner
from nodepool.api.problems import Problem

from . import holds, line_appeals, payouts, periods, webhooks
from .admin_base import ReadOnlyForOwners
from .models import (
    LineAppeal,
    MismatchItem,
    NodeAvailability,
    Payout,
    PayoutDelivery,
    PayoutHold,
    PoolPeriod,
    StatementLine,
)


def history(subject_type: str, obj) -> str:
    """The events of one payout, hold or line appeal, oldest first, as a small table (its owner
    reads them here: they are theirs, fleet.api.events)."""
    if obj is None or obj.pk is None:
        return "-"
    rows = NodeEvent.objects.filter(subject_type=subject_type, subject_id=str(obj.pk)).order_by("created_at", "id")
    if not rows:
        return "-"
    body = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        ((e.created_at.strftime("%Y-%m-%d %H:%M:%S UTC"), e.from_state or "-", e.to_state, e.reason) for e in rows),
    )
    return format_html(
        '<table class="money-history"><thead><tr><th>at</th><th>from</th><th>to</th><th>reason</th></tr></thead>'
        "<tbody>{}</tbody></table>",
        body,
    )


class ReadOnly(ReadOnlyRecordAdminMixin, OperatorOnlyAdmin):
    """Rows the services write: operators read them here and act through the actions."""


@admin.register(NodeAvailability)
class NodeAvailabilityAdmin(ReadOnly):
    list_display = ["node", "pool", "owner", "started_at", "last_seen_at", "end_reason"]
    list_filter = ["pool", "end_reason"]
    list_select_related = ["node", "pool", "owner"]


@admin.action(description="Reconcile selected pool periods now")
def reconcile_periods(modeladmin, request, queryset):
    actor = Actor.from_request(request)
    states = []
    for period in queryset:
        try:
            states.append(periods.reconcile_period(period_id=period.pk, actor=actor).state)
        except Exception as exc:  # a period not over yet: say so, go on with the others
            states.append(f"refused ({exc})")
    modeladmin.message_user(request, f"Pool periods: {', '.join(states)}.")


@admin.register(PoolPeriod)
class PoolPeriodAdmin(ReadOnly):
    list_display = ["__str__", "pool", "period", "period_start", "state", "idle_paid", "reconciled_at"]
    list_filter = ["state", "pool", "period"]
    list_select_related = ["pool"]
    actions = [reconcile_periods]
    readonly_fields = ["offered", "usage", "idle", "unallocated", "money", "waiting_for", "runs", "version"]


def _resolve_item(item, version, actor, data):
    periods.resolve_mismatch(item_id=item.pk, reason=data["reason"], expected_version=version, actor=actor)


@admin.action(description="Resolve selected mismatch items (with a reason)…")
def resolve_items(modeladmin, request, queryset):
    spec = Spec("Resolve mismatch item", "marketplace.change_mismatchitem", ReasonForm, _resolve_item)
    return run_with_form(modeladmin, request, queryset, spec, lambda item: item.version)


@admin.register(MismatchItem)
class MismatchItemAdmin(ReadOnly):
    list_display = ["__str__", "period", "kind", "message", "resolved_at"]
    list_filter = ["kind", ("resolved_at", admin.EmptyFieldListFilter)]
    actions = [resolve_items]


class OwnersRead(ReadOnlyForOwners):
    """Operators read all and act; owners read their own rows (``owner_field``)."""

    def _operator(self, request):
        return is_operator(request.user)

    def _owner(self, request):
        return is_owner(request.user)


@admin.action(description="Approve selected payouts (a second operator)")
def approve_payouts(modeladmin, request, queryset):
    actor, done = Actor.from_request(request), []
    for payout in queryset:
        try:
            done.append(payouts.payout_approve(payout_id=payout.pk, expected_version=payout.version, actor=actor).state)
        except Exception as exc:  # the requester, a hold, a stale version: say so per payout
            done.append(f"refused ({exc})")
    modeladmin.message_user(request, f"Payouts: {', '.join(done)}.")


def _fail(payout, version, actor, data):
    payouts.payout_mark_failed(payout_id=payout.pk, reason=data["reason"], expected_version=version, actor=actor)


def _reverse(payout, version, actor, data):
    payouts.payout_reverse(payout_id=payout.pk, reason=data["reason"], expected_version=version, actor=actor)


class PaidForm(forms.Form):
    external_reference = forms.CharField(max_length=200, help_text="The payment system's reference of the transfer.")


def _paid(payout, version, actor, data):
    payouts.payout_mark_paid(
        payout_id=payout.pk, external_reference=data["external_reference"], expected_version=version, actor=actor
    )


@admin.action(description="Mark selected approved payouts paid (with the external reference)…")
def pay_payouts(modeladmin, request, queryset):
    spec = Spec("Mark payout paid", "marketplace.change_payout", PaidForm, _paid)
    return run_with_form(modeladmin, request, queryset, spec, lambda payout: payout.version)


@admin.action(description="Mark selected payouts failed (with a reason)…")
def fail_payouts(modeladmin, request, queryset):
    spec = Spec("Mark payout failed", "marketplace.change_payout", ReasonForm, _fail)
    return run_with_form(modeladmin, request, queryset, spec, lambda payout: payout.version)


@admin.action(description="Reverse selected paid payouts (chargeback, with a reason)…")
def reverse_payouts(modeladmin, request, queryset):
    spec = Spec("Reverse payout", "marketplace.change_payout", ReasonForm, _reverse)
    return run_with_form(modeladmin, request, queryset, spec, lambda payout: payout.version)


@admin.register(Payout)
class PayoutAdmin(OwnersRead):
    list_display = ["uid", "statement", "owner", "amount", "currency", "state", "external_reference", "requested_at"]
    list_filter = ["state", "currency"]
    list_select_related = ["owner"]
    actions = [approve_payouts, pay_payouts, fail_payouts, reverse_payouts]
    readonly_fields = ["history"]

    @admin.display(description="history")
    def history(self, obj):
        return history("payout", obj)


def _release(hold, version, actor, data):
    holds.hold_release(hold_id=hold.pk, reason=data["reason"], expected_version=version, actor=actor)


@admin.action(description="Release selected payout holds (with a reason)…")
def release_holds(modeladmin, request, queryset):
    spec = Spec("Release payout hold", "marketplace.change_payouthold", ReasonForm, _release)
    return run_with_form(modeladmin, request, queryset, spec, lambda hold: hold.version)


@admin.register(PayoutHold)
class PayoutHoldAdmin(OwnersRead):
    owner_field = "statement__owner"
    list_display = ["__str__", "statement", "reason", "message", "created_at", "released_at"]
    list_filter = ["reason", ("released_at", admin.EmptyFieldListFilter)]
    actions = [release_holds]
    readonly_fields = ["history"]

    @admin.display(description="history")
    def history(self, obj):
        return history("payout_hold", obj)


def _reject(appeal, version, actor, data):
    line_appeals.line_appeal_resolve(
        appeal_id=appeal.pk, outcome="rejected", resolution=data["reason"], amount=None,
        expected_version=version, actor=actor,
    )  # fmt: skip


@admin.action(description="Reject selected line appeals (the line stands)…")
def reject_line_appeals(modeladmin, request, queryset):
    spec = Spec("Reject line appeal", "marketplace.change_lineappeal", ReasonForm, _reject)
    return run_with_form(modeladmin, request, queryset, spec, lambda appeal: appeal.version)


class CorrectionForm(ReasonForm):
    amount = forms.DecimalField(
        max_digits=17,
        decimal_places=2,
        help_text="The correction, positive or negative (e.g. -1.20), in the line's currency.",
    )

    def clean_amount(self):
        amount = self.cleaned_data["amount"]
        if amount == Decimal(0):
            raise forms.ValidationError("A correction is not zero; reject the appeal instead.")
        return amount


def _correct(appeal, version, actor, data):
    line_appeals.line_appeal_resolve(
        appeal_id=appeal.pk, outcome="corrected", resolution=data["reason"], amount=data["amount"],
        expected_version=version, actor=actor,
    )  # fmt: skip


@admin.action(description="Correct selected line appeals (a correction line on the next statement)…")
def correct_line_appeals(modeladmin, request, queryset):
    spec = Spec("Correct line appeal", "marketplace.change_lineappeal", CorrectionForm, _correct)
    return run_with_form(modeladmin, request, queryset, spec, lambda appeal: appeal.version)


class LineAppealMessageForm(forms.Form):
    message = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 5, "cols": 80}),
        help_text="What is wrong with this line (an operator reads it and corrects or rejects the line).",
    )


@admin.register(LineAppeal)
class LineAppealAdmin(OwnersRead):
    """Operators correct or reject appeals (actions); owners read theirs, file one from a line of
    their statement page (``<line>/file/``) and withdraw an open one (``<appeal>/withdraw/``), both
    through the API's services (marketplace.payouts: own lines of final unpaid statements, once per
    line)."""

    list_display = ["__str__", "line", "owner", "state", "correction_amount", "created_at", "resolved_at"]
    list_filter = ["state"]
    list_select_related = ["owner"]
    actions = [correct_line_appeals, reject_line_appeals]
    readonly_fields = ["history"]

    def get_readonly_fields(self, request, obj=None):
        owner = self._owner(request) and not self._operator(request)
        return [*self.readonly_fields, "withdraw"] if owner else self.readonly_fields

    @admin.display(description="history")
    def history(self, obj):
        return history("line_appeal", obj)

    @admin.display(description="withdraw")
    def withdraw(self, obj):
        if obj is None or obj.state != "open":
            return "-"
        url = reverse("admin:marketplace_lineappeal_withdraw", args=[obj.pk])
        return format_html('<a href="{}">Withdraw this appeal</a>', url)

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("<int:line_id>/file/", view(self.file_view), name="marketplace_lineappeal_file"),
            path("<int:appeal_id>/withdraw/", view(self.withdraw_view), name="marketplace_lineappeal_withdraw"),
            *super().get_urls(),
        ]

    def _owner_only(self, request):
        if not self._owner(request) or self._operator(request):
            raise PermissionDenied("Owners appeal their own lines.")

    def _page(self, request, title, subject, form, submit):
        context = {
            **self.admin_site.each_context(request),
            "opts": self.model._meta,
            "title": title,
            "subject": subject,
            "form": form,
            "submit": submit,
        }
        return TemplateResponse(request, "admin/marketplace/line_appeal_form.html", context)

    def file_view(self, request, line_id):
        """GET: the form (a message); POST: ``line_appeals.line_appeal_create``; a refusal is shown
        on the form (409: not final, paid, appealed already), another owner's line is a 404."""
        self._owner_only(request)
        line = StatementLine.objects.filter(pk=line_id, statement__owner=request.user).first()
        if line is None:
            raise Http404("No such statement line.")
        form = LineAppealMessageForm(request.POST if request.method == "POST" else None)
        if request.method == "POST" and form.is_valid():
            try:
                appeal = line_appeals.line_appeal_create(
                    owner=request.user, line_id=line.pk, message=form.cleaned_data["message"],
                    actor=Actor.from_request(request),
                )  # fmt: skip
            except Problem as exc:
                if exc.status_code == 404:
                    raise Http404(str(exc.detail)) from exc
                form.add_error(None, str(exc.detail))
            else:
                messages.success(request, f"Line {line.pk} appealed; an operator will correct or reject it.")
                return redirect("admin:marketplace_lineappeal_change", appeal.pk)
        return self._page(request, "Appeal a statement line", line, form, "Appeal this line")

    def withdraw_view(self, request, appeal_id):
        """GET: a confirmation; POST: ``line_appeals.line_appeal_withdraw`` (only the owner's open appeal)."""
        self._owner_only(request)
        appeal = LineAppeal.objects.filter(pk=appeal_id, owner=request.user).select_related("line").first()
        if appeal is None:
            raise Http404("No such line appeal.")
        form = forms.Form(request.POST if request.method == "POST" else None)
        if request.method == "POST" and form.is_valid():
            try:
                line_appeals.line_appeal_withdraw(
                    appeal_id=appeal.pk, owner=request.user, actor=Actor.from_request(request)
                )
            except Problem as exc:
                form.add_error(None, str(exc.detail))
            else:
                messages.success(request, f"Appeal of line {appeal.line_id} withdrawn.")
                return redirect("admin:marketplace_statement_change", appeal.line.statement_id)
        return self._page(request, "Withdraw a line appeal", appeal, form, "Withdraw this appeal")


@admin.action(description="Retry selected undelivered notices (a fresh set of attempts, due now)")
def retry_deliveries(modeladmin, request, queryset):
    count = webhooks.retry(queryset.values_list("pk", flat=True))
    modeladmin.message_user(request, f"{count} payout webhook notice(s) due again; delivered ones were left alone.")


@admin.register(PayoutDelivery)
class PayoutDeliveryAdmin(ReadOnly):
    """The payout webhook's outbox (marketplace.webhooks): what was sent, what is pending and why;
    operators retry notices that gave up (alert NodepoolPayoutWebhooksGaveUp) once the cause is fixed."""

    actions = [retry_deliveries]

    list_display = ["delivery_id", "payout", "created_at", "attempts", "delivered_at", "next_attempt_at", "last_error"]
    list_filter = [("delivered_at", admin.EmptyFieldListFilter)]
