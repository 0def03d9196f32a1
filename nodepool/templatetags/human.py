"""Template filters for people's times, so every admin page writes them the one way humanunits does
(issue 33 item 4): ``{% load human %}{{ event.created_at|timestamp }}`` → ``2026-12-02 09:48:53 UTC``,
``{{ node.last_heartbeat_at|moment }}`` → ``2026-12-02 09:48:53 UTC (12m ago)``.
"""

from __future__ import annotations

from django import template

import humanunits

register = template.Library()


@register.filter
def timestamp(value) -> str:
    """``datetime`` (aware) or ISO string → ``"2026-12-02 09:48:53 UTC"``; ``None`` → ``"-"``."""
    return humanunits.timestamp(value)


@register.filter
def moment(value) -> str:
    """``datetime`` (aware) or ISO string → ``"2026-12-02 09:48:53 UTC (12m ago)"``; ``None`` → ``"never"``."""
    return humanunits.moment(value)
