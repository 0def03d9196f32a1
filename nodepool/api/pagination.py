from rest_framework.exceptions import NotFound
from rest_framework.pagination import CursorPagination, PageNumberPagination

from nodepool.api.errors import INVALID_CURSOR, INVALID_PAGE, INVALID_PAGE_SIZE

from .problems import Problem


def _positive_int(raw: str) -> bool:
    # No int(): a string of thousands of digits would raise; DRF caps or 404s the big ones itself.
    return raw.isascii() and raw.isdigit() and raw.strip("0") != ""


class Pagination(PageNumberPagination):
    """Page-number pagination; ``page_size`` may be chosen up to 500 (larger values are capped).

    Malformed values are refused rather than silently replaced by the default (DRF ignores a bad
    ``page_size`` and answers 404 for a bad ``page``):

    Raises:
        Problem: 400 ``invalid_page_size`` (not a positive integer), 400 ``invalid_page`` (not a
            positive integer or ``last``). A page past the end stays 404 ``not_found``.
    """

    page_size_query_param = "page_size"
    max_page_size = 500

    def paginate_queryset(self, queryset, request, view=None):
        page = request.query_params.get(self.page_query_param)
        if page is not None and page not in self.last_page_strings and not _positive_int(page):
            raise Problem(f"page must be a positive integer or 'last', not {page[:40]!r}.", INVALID_PAGE)
        return super().paginate_queryset(queryset, request, view)

    def get_page_size(self, request):
        raw = request.query_params.get(self.page_size_query_param)
        if raw is not None and not _positive_int(raw):
            raise Problem(
                f"page_size must be an integer from 1 to {self.max_page_size}, not {raw[:40]!r}.", INVALID_PAGE_SIZE
            )
        return super().get_page_size(request)

    def get_schema_operation_parameters(self, view):
        """DRF's parameters, with the bounds the view enforces (``page`` also takes ``last``)."""
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] in (self.page_query_param, self.page_size_query_param):
                parameter["schema"] = {"type": "integer", "minimum": 1}
            if parameter["name"] == self.page_size_query_param:
                parameter["description"] = f"Results per page (1 to {self.max_page_size}; larger values are capped)."
        return parameters


class EventCursorPagination(CursorPagination):
    """Cursor pagination over events, newest first: stable while new events arrive (a page number
    would shift under a busy log). ``page_size`` up to 500; a mangled cursor is a 400.

    Raises:
        Problem: 400 ``invalid_cursor``, 400 ``invalid_page_size``.
    """

    ordering = ("-created_at", "-id")
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500

    def decode_cursor(self, request):
        if request.query_params.get(self.cursor_query_param) == "":
            # DRF reads an empty cursor as the first page; like an empty filter, it is refused.
            raise Problem("The cursor is not one this API returned.", INVALID_CURSOR)
        try:
            return super().decode_cursor(request)
        except NotFound:
            raise Problem("The cursor is not one this API returned.", INVALID_CURSOR) from None

    def get_page_size(self, request):
        raw = request.query_params.get(self.page_size_query_param)
        if raw is not None and not _positive_int(raw):
            raise Problem(
                f"page_size must be an integer from 1 to {self.max_page_size}, not {raw[:40]!r}.", INVALID_PAGE_SIZE
            )
        return super().get_page_size(request)


class TimelineCursorPagination(EventCursorPagination):
    """The same, oldest first: a node's story read from enrollment on."""

    ordering = ("created_at", "id")
