from rest_framework.pagination import PageNumberPagination


class Pagination(PageNumberPagination):
    """Page-number pagination; ``page_size`` may be chosen up to 500."""

    page_size_query_param = "page_size"
    max_page_size = 500
