"""Template filters for the project's roles, so admin templates offer only what the user may open.

``{% load roles %}{% if request.user|is_operator %}…{% endif %}``
"""

from __future__ import annotations

from django import template

from nodepool.api import permissions

register = template.Library()


@register.filter
def is_operator(user) -> bool:
    """True for superusers and members of the ``operators`` group (nodepool.api.permissions)."""
    return permissions.is_operator(user)
