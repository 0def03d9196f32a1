"""Admin pages of maintenance outside a model's change list: the drain form of one node.

``/admin/fleet/node/<id>/drain/`` is the drain form's own, linkable URL (issue 33 item 6): the
node page's "Drain…" opens it, an operator may bookmark or send it. It is the bulk action's form
(maintenance.admin.DRAIN: policy, a deadline one hour ahead unless changed, a reason, a dry run),
for one node, with the node's version read when the form was drawn.
"""

from __future__ import annotations

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.urls import reverse

from fleet.models import Node
from nodepool.api.permissions import is_operator

from .admin import DRAIN, run_with_form


def node_drain_view(request, pk):
    """GET draws the form; POST ``preview`` shows the dry run; POST ``apply`` drains and returns
    to the node page (a refusal is a message there, and nothing changes). Operators with the
    ``fleet.operate_node`` permission only (403 otherwise); an unknown node is 404."""
    if not is_operator(request.user) or not request.user.has_perm(DRAIN.permission):
        raise PermissionDenied
    model_admin = admin.site._registry[Node]
    node = get_object_or_404(Node, pk=pk)
    node_page = reverse("admin:fleet_node_change", args=[node.pk])
    response = run_with_form(model_admin, request, Node.objects.filter(pk=node.pk), DRAIN,
                             lambda n: n.version, back=node_page)  # fmt: skip
    return HttpResponseRedirect(node_page) if response is None else response
