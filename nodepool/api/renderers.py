from rest_framework.renderers import JSONRenderer


class ProblemAwareJSONRenderer(JSONRenderer):
    """The API's JSON renderer. Error responses set their own ``application/problem+json``
    content type (see :mod:`nodepool.api.problems`)."""

    media_type = "application/json"


class ProblemJSONRenderer(JSONRenderer):
    """Lets a client that accepts only ``application/problem+json`` still be answered (errors)."""

    media_type = "application/problem+json"
