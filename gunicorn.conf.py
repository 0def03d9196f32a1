"""gunicorn settings read from the working directory by every ``gunicorn`` start (Procfile, Docker,
the demo, the tests). Command-line flags still win.

Header limits: the application refuses a header above ``NODEPOOL_MAX_HEADER_BYTES`` (8 KiB) with
431 problem+json (nodepool.api.middleware.HeaderLimitMiddleware). gunicorn's own limits are set
above the application's so that it sees such requests; beyond them gunicorn answers with its own
plain-text 400/431 page before any application code runs (documented in docs/foundation.md).
"""

limit_request_field_size = 16384  # bytes per header line (gunicorn's default 8190 < our limit)
limit_request_fields = 100  # headers per request (gunicorn's default)
limit_request_line = 8190  # request line (method, path, query); gunicorn's maximum
