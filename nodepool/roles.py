"""The three roles as Django groups, with model permissions, kept in step after every migrate."""

from django.contrib.auth.models import Group, Permission

from .api.permissions import CLIENTS, OPERATORS, OWNERS

# app_label -> codename prefixes (or full codenames) each role receives.
ROLE_PERMISSIONS = {
    OPERATORS: {"fleet": ["*"], "leases": ["*"], "maintenance": ["*"], "django_celery_beat": ["*"]},
    OWNERS: {"fleet": ["view_node", "view_pool", "view_nodeevent", "view_admissioncheck"]},
    CLIENTS: {
        "leases": ["add_lease", "view_lease", "change_lease", "add_leaserequest", "view_leaserequest", "view_shape"],
        "fleet": ["view_pool"],
    },
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
