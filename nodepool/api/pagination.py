from rest_framework.pagination import PageNumberPagination

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
            raise Problem(f"page must be a positive integer or 'last', not {page[:40]!r}.", "invalid_page")
        return super().paginate_queryset(queryset, request, view)

    def get_page_size(self, request):
        raw = request.query_params.get(self.page_size_query_param)
        if raw is not None and not _positive_int(raw):
            raise Problem(
                f"page_size must be an integer from 1 to {self.max_page_size}, not {raw[:40]!r}.", "invalid_page_size"
            )
        return super().get_page_size(request)
