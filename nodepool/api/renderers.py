from rest_framework.renderers import JSONRenderer


class ProblemAwareJSONRenderer(JSONRenderer):
    """The API's JSON renderer. Error responses set their own ``application/problem+json``
    content type (see :mod:`nodepool.api.problems`)."""

    media_type = "application/json"
