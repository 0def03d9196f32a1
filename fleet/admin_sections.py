"""Sections of the node page in the admin, contributed by the apps that own their data.

The fleet app draws the node's own sections (summary, capability, resources, conditions,
events). Higher apps (leases: the node's leases; maintenance: drain, quarantine, holds and the
action buttons) register theirs here from their own ``admin.py``, so fleet never imports them
(dependencies point one way; docs/foundation.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NodeSection:
    """One section of the node page.

    ``context(request, node)`` returns the template's context (a dict), or None to leave the
    section out for this request (e.g. actions for a user who may not act). ``order`` sorts the
    sections top to bottom; ``template`` is rendered with ``section`` and ``data`` in its context.
    """

    key: str
    title: str
    order: int
    template: str
    context: Callable[[Any, Any], dict | None]


_SECTIONS: dict[str, NodeSection] = {}


def register_node_section(section: NodeSection) -> None:
    """Add (or replace, by ``key``) a section of the node page."""
    _SECTIONS[section.key] = section


def node_sections(request, node) -> list[tuple[NodeSection, dict]]:
    """The sections to draw for ``node`` and ``request``, in order, each with its context."""
    drawn = []
    for section in sorted(_SECTIONS.values(), key=lambda s: (s.order, s.key)):
        data = section.context(request, node)
        if data is not None:
            drawn.append((section, data))
    return drawn
