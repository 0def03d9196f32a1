"""The three roles as Django groups, with model permissions, kept in step after every migrate."""

from django.contrib.auth.models import Group, Permission

from .api.permissions import CLIENTS, FENCING_VALIDATORS, OPERATORS, OWNERS

# app_label -> codename prefixes (or full codenames) each role receives.
ROLE_PERMISSIONS = {
    OPERATORS: {
        "fleet": ["*"],
        "leases": ["*"],
        "maintenance": ["*"],
        "operations": ["*"],
        "marketplace": ["*"],
        "django_celery_beat": ["*"],
    },  # fmt: skip
    OWNERS: {
        "fleet": ["view_node", "view_pool", "view_nodeevent", "view_admissioncheck"],
        # Their usage, statements and appeals (scoped to their own rows by the admin and the API).
        "marketplace": [
            "view_usagerecord",
            "view_statement",
            "view_statementline",
            "view_appeal",
            "add_appeal",
            "view_ownedlease",
            "view_ownedquarantine",
        ],
    },
    CLIENTS: {
        "leases": ["add_lease", "view_lease", "change_lease", "add_leaserequest", "view_leaserequest", "view_shape"],
        "fleet": ["view_pool"],
    },
    # No model permission: POST /fencing/validate checks the group itself.
    FENCING_VALIDATORS: {},
}


def ensure_roles(sender=None, **kwargs) -> None:
    """Create the role groups and grant their permissions (idempotent; runs on post_migrate)."""
    for role, grants in ROLE_PERMISSIONS.items():
        group, _ = Group.objects.get_or_create(name=role)
        perms = []
        for app_label, codenames in grants.items():
            qs = Permission.objects.filter(content_type__app_label=app_label)
            if codenames != ["*"]:
                qs = qs.filter(codename__in=codenames)
            perms.extend(qs)
        group.permissions.add(*perms)
