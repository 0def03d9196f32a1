"""Content negotiation that answers clients which accept only ``application/problem+json``."""

from __future__ import annotations

from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation

PROBLEM_JSON = "application/problem+json"


class ProblemAwareNegotiation(DefaultContentNegotiation):
    """DRF's negotiation, except that ``Accept: application/problem+json`` alone is served JSON.

    Such a client wants to read our errors; refusing it with 406 would hide the error it asked
    about. Error bodies then go out as ``application/problem+json`` (set by the exception handler).
    Listing a problem+json renderer instead would advertise it for every success in the schema.
    """

    def select_renderer(self, request, renderers, format_suffix=None):
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except NotAcceptable:
            if PROBLEM_JSON in request.META.get("HTTP_ACCEPT", ""):
                for renderer in renderers:
                    if renderer.media_type == "application/json":
                        return renderer, renderer.media_type
            raise
