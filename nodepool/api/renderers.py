from rest_framework.renderers import JSONRenderer


class ProblemAwareJSONRenderer(JSONRenderer):
    """JSON renderer that also serves ``application/problem+json`` error responses.

    Error responses set their own content type; listing it here keeps content negotiation from
    refusing a client that sent ``Accept: application/problem+json``.
    """

    media_type = "application/json"
