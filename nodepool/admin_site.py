"""The operators' console: the stock Django admin site, named and arranged as nodepool's (issue 33 item 6).

- nodepool's name on every page, the login page included (``site_header`` / ``site_title``);
- the index and the navigation sidebar list what operators use first, in the order they use it
  (fleet, leases, maintenance, pool operations, marketplace), each model once; a model an app
  adds later lands in its app's section by itself;
- internals (users and groups, login attempts, API tokens, fencing sequences, consistency
  reports, Celery beat's schedules…) are grouped apart under "Internals", shown to superusers
  only: operators may still open what their permissions allow, by URL, but the index is theirs;
- "View site" opens the fleet overview for operators, and the node list for marketplace owners
  (the overview is operators' only).

Installed through :class:`nodepool.apps.NodepoolAdminConfig` (``default_site``), so ``admin.site``
is this site and every app keeps registering with ``@admin.register``. ``/admin/<app>/`` pages
keep Django's per-app lists (breadcrumbs link there).
"""

from __future__ import annotations

from django.contrib import admin
from django.urls import reverse

from nodepool.api.permissions import is_operator

NAME = "nodepool"

# (section title, apps whose models belong there unless listed elsewhere, models in reading order).
# A model is "app_label.modelname"; models of the apps not listed anywhere go to "Internals".
SECTIONS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("Fleet", ("fleet",), ("fleet.node", "fleet.pool", "fleet.device", "fleet.bootstraptoken")),
    ("Leases", ("leases",), ("leases.lease", "leases.leaserequest", "leases.shape")),
    ("Maintenance", ("maintenance",), ("maintenance.drain", "maintenance.quarantine", "maintenance.disruptionbudget")),
    (
        "Pool operations",
        ("operations",),
        (
            "operations.pooloperations",
            "operations.upgrade",
            "operations.scaledecision",
            "operations.providermachine",
            "operations.preemption",
        ),
    ),  # fmt: skip
    (
        "Marketplace",
        ("marketplace",),
        (
            "marketplace.statement",
            "marketplace.usagerecord",
            "marketplace.ownedlease",
            "marketplace.ownedquarantine",
            "marketplace.appeal",
            "marketplace.lineappeal",
            "marketplace.payout",
            "marketplace.payouthold",
            "marketplace.poolprice",
            "marketplace.poolsettlement",
            "marketplace.poolperiod",
        ),
    ),  # fmt: skip
]
INTERNALS = "Internals"
# Models of the operators' apps that are internals all the same: records the control plane keeps
# for itself, read when debugging, not when running the fleet.
INTERNAL_MODELS = frozenset({"leases.fencingsequence", "leases.consistencyreport"})
# Pages written for marketplace owners ("Leases on my nodes"): an operator who owns no node has
# the operators' own pages for the same records.
OWNER_VIEWS = frozenset({"marketplace.ownedlease", "marketplace.ownedquarantine"})


def _key(model: dict) -> str:
    opts = model["model"]._meta
    return f"{opts.app_label}.{opts.model_name}"


class NodepoolAdminSite(admin.AdminSite):
    site_header = NAME
    site_title = NAME
    index_title = "Fleet console"

    def each_context(self, request):
        context = super().each_context(request)
        if getattr(request, "user", None) is not None and request.user.is_active:
            context["site_url"] = reverse(
                "admin-fleet-overview" if is_operator(request.user) else "admin:fleet_node_changelist"
            )
        return context

    def get_app_list(self, request, app_label=None):
        """The index's sections (see the module docstring); ``app_label`` given: Django's own list."""
        if app_label is not None:
            return super().get_app_list(request, app_label)
        apps = self._build_app_dict(request)
        models = {_key(m): (app, m) for app in apps.values() for m in app["models"]}
        operator = is_operator(request.user)
        placed: set[str] = set()
        sections = []
        for title, app_labels, order in SECTIONS:
            keys = [k for k in order if k in models]
            keys += sorted((k for k in models if k.split(".")[0] in app_labels and k not in order),
                           key=lambda k: models[k][1]["name"])  # fmt: skip
            keys = [k for k in keys if k not in INTERNAL_MODELS and not (operator and k in OWNER_VIEWS)]
            placed.update(keys)
            entries = [models[k][1] for k in keys]
            if title == "Fleet" and operator:
                entries.insert(0, self._overview_entry())
            if entries:
                first_app = models[keys[0]][0] if keys else apps.get("fleet", {})
                sections.append(self._section(title, first_app, entries))
        if request.user.is_superuser:
            rest = sorted((k for k in models if k not in placed and k not in OWNER_VIEWS),
                          key=lambda k: (models[k][0]["name"], models[k][1]["name"]))  # fmt: skip
            if rest:
                entries = [models[k][1] for k in rest]
                sections.append({**self._section(INTERNALS, models[rest[0]][0], entries), "app_url": "#internals"})
        return sections

    @staticmethod
    def _section(title: str, app: dict, entries: list[dict]) -> dict:
        # app_label stays the first app's own: the stock templates give the module a CSS class
        # and a "current app" highlight from it.
        return {
            "name": title,
            "app_label": app.get("app_label", title.lower()),
            "app_url": app.get("app_url", ""),
            "has_module_perms": True,
            "models": entries,
        }

    @staticmethod
    def _overview_entry() -> dict:
        return {
            "name": "Fleet overview",
            "object_name": "FleetOverview",
            "admin_url": reverse("admin-fleet-overview"),
            "add_url": None,
            "view_only": True,
            "perms": {"add": False, "change": False, "delete": False, "view": True},
        }
