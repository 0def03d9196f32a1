from rest_framework.renderers import BrowsableAPIRenderer, JSONRenderer


class ProblemAwareJSONRenderer(JSONRenderer):
    """The API's JSON renderer. Error responses set their own ``application/problem+json``
    content type (see :mod:`nodepool.api.problems`)."""

    media_type = "application/json"


class ProblemAwareBrowsableAPIRenderer(BrowsableAPIRenderer):
    """The browsable API for successes; an error is rendered as its problem+json body, whatever the
    ``Accept`` header asked for (a browser asking ``text/html`` otherwise got 13 KB of HTML labelled
    ``application/problem+json``)."""

    def render(self, data, accepted_media_type=None, renderer_context=None):
        response = (renderer_context or {}).get("response")
        if response is not None and response.status_code >= 400:
            return JSONRenderer().render(data, "application/json", renderer_context)
        return super().render(data, accepted_media_type, renderer_context)
