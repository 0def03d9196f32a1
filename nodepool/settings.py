"""Django settings for nodepool, read from the environment (twelve-factor).

Variables (all optional; with none set, nodepool runs on the embedded default):

``DATABASE_URL``       database URL; default ``sqlite:///<BASE_DIR>/var/nodepool.sqlite3``
``CELERY_BROKER_URL``  broker URL; default kombu's SQLAlchemy transport on ``var/celery-broker.sqlite3``
``CELERY_RESULT_BACKEND``  default: the Django database is not used; ``db+sqlite`` under ``var/``
``SECRET_KEY``         default: generated once into ``var/secret_key`` (never committed)
``DEBUG``              default off
``ALLOWED_HOSTS``      comma-separated; default ``localhost,127.0.0.1,[::1]``
``CELERY_TASK_ALWAYS_EAGER``  run tasks inline (tests only)
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import environ

from nodepool.api.areas import TAGS as API_TAGS
from nodepool.structured_logs import configure_structlog, logging_config

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(environ.Env().str("NODEPOOL_VAR_DIR", default=str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

env = environ.Env(
    DEBUG=(bool, False),
    ALLOWED_HOSTS=(list, ["localhost", "127.0.0.1", "[::1]", "testserver"]),
)


def _var_secret(filename: str) -> str:
    """A secret generated once into ``var/<filename>`` (0600) and read back by every process.

    Several processes start at once (gunicorn workers, Celery worker and beat), so the file is
    published atomically: written to a private temporary file, then hard-linked into place,
    which fails if another process got there first. Every process then reads the one winner.
    """
    path = VAR_DIR / filename
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=VAR_DIR, prefix=f".{filename}.")  # created 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(50))
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return path.read_text().strip()


def _secret_key() -> str:
    """The SECRET_KEY from the environment, or one generated once into var/secret_key."""
    return env.str("SECRET_KEY", default="") or _var_secret("secret_key")


SECRET_KEY = _secret_key()
DEBUG = env("DEBUG")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "nodepool.apps.NodepoolAdminConfig",  # django.contrib.admin, with nodepool's site (nodepool/admin_site.py)
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "knox",  # hashed, expiring user API tokens (nodepool.tokens)
    "axes",  # login lockout (admin and browsable-API login)
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI served from our static files, not a CDN
    "django_celery_beat",
    "django_structlog",
    "nodepool.apps.NodepoolConfig",
    "fleet",
    "leases",
    "maintenance",
    "operations",
    "marketplace",
]

MIDDLEWARE = [
    # First: REMOTE_ADDR is the client's address from here on (NODEPOOL_TRUSTED_PROXIES).
    "nodepool.proxies.TrustedProxyMiddleware",
    "nodepool.api.middleware.RequestIdMiddleware",
    # An address over its failed-authentication limit: 429 before any lookup (nodepool.auth_failures).
    "nodepool.auth_failures.FailedAuthGate",
    # A request whose database never answers ends at its deadline as 503 database_timeout.
    "nodepool.db_deadline.DatabaseDeadlineMiddleware",
    # A flooding node's repeated 429 answered before everything else (fleet.api.renewal_views).
    "fleet.api.renewal_views.RenewalFloodGate",
    "nodepool.api.middleware.HeaderLimitMiddleware",
    "nodepool.api.middleware.ProblemJsonMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    # Before anything that may read the body (CSRF reads POST forms).
    "nodepool.api.middleware.BodyLimitMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Structured request logs (nodepool.structured_logs): after authentication, so a session user is known.
    "django_structlog.middlewares.RequestMiddleware",
    # Adds Retry-After to the lockout page of the per-account ceiling (nodepool.auth_backends).
    "nodepool.auth_backends.LoginRetryAfterMiddleware",
    "axes.middleware.AxesMiddleware",  # last: turns a lockout into the lockout page (429)
]

ROOT_URLCONF = "nodepool.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # Before the apps' templates: admin/base_site.html here overrides the stock admin's.
        "DIRS": [BASE_DIR / "nodepool" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
WSGI_APPLICATION = "nodepool.wsgi.application"

# --- Database -------------------------------------------------------------------------------
# Timeouts (docs/foundation.md): a database that accepts connections and never answers must cost
# a web request seconds, not minutes. nodepool/wsgi.py marks web processes (PROCESS_KIND "web");
# Celery sweeps, migrations and management commands get the longer (default: no) statement timeout.
PROCESS_KIND = env.str("NODEPOOL_PROCESS_KIND", default="")
NODEPOOL_DB_CONNECT_TIMEOUT = env.int("NODEPOOL_DB_CONNECT_TIMEOUT", default=3)
NODEPOOL_DB_STATEMENT_TIMEOUT_MS = env.int("NODEPOOL_DB_STATEMENT_TIMEOUT_MS", default=5_000)
# Web requests: a query still unanswered this many seconds after the request began is cut
# (nodepool.db_deadline): a hung server that never sees the query cannot cancel it itself.
NODEPOOL_REQUEST_DB_DEADLINE = env.float("NODEPOOL_REQUEST_DB_DEADLINE", default=5.0)
# TCP keepalives and tcp_user_timeout (libpq): a server whose host vanished is noticed in seconds.
NODEPOOL_DB_TCP_USER_TIMEOUT_MS = env.int("NODEPOOL_DB_TCP_USER_TIMEOUT_MS", default=10_000)
NODEPOOL_DB_SWEEP_STATEMENT_TIMEOUT_MS = env.int("NODEPOOL_DB_SWEEP_STATEMENT_TIMEOUT_MS", default=0)
NODEPOOL_READYZ_BUDGET = env.float("NODEPOOL_READYZ_BUDGET", default=2.5)


def postgres_options(
    *,
    connect_timeout: int,
    statement_timeout_ms: int,
    jit: bool = False,
    generic_plans: bool = True,
    tcp_user_timeout_ms: int = 10_000,
) -> dict:
    """libpq connection options: ``connect_timeout`` (seconds), TCP keepalives and
    ``tcp_user_timeout`` (``tcp_user_timeout_ms``), a session ``statement_timeout`` (milliseconds;
    0 = none), ``jit`` and ``plan_cache_mode``, set at connect so that no request pays an extra
    statement.

    JIT compilation is off unless asked for: PostgreSQL compiles any query whose *estimated* cost
    passes ``jit_above_cost``, and the grouped queries of a 409 explanation on 10,000 nodes spent
    18 of their 30 ms compiling (PostgreSQL's docs: JIT pays off for long CPU-bound analytics, and
    its overhead outweighs it on short queries). ``NODEPOOL_DB_JIT=1`` turns it back on.

    ``generic_plans``: prepared statements are planned once (``plan_cache_mode=force_generic_plan``).
    Only the statements of ``nodepool.db.prepared_cursor`` are prepared or bound on the server;
    Django's own cursors bind on the client, so the option changes no other plan. Pass False
    when Django binds on the server (``OPTIONS["server_side_binding"]``).
    """
    options = {
        "connect_timeout": connect_timeout,
        # Probes every 2 s after 5 s idle, dead after 3 unanswered; unacknowledged data for
        # tcp_user_timeout ms closes the connection (a host that vanished mid-query).
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": tcp_user_timeout_ms,
    }
    settings = [] if jit else ["-c jit=off"]
    if statement_timeout_ms > 0:
        settings.append(f"-c statement_timeout={statement_timeout_ms}")
    if generic_plans:
        settings.append("-c plan_cache_mode=force_generic_plan")
    if settings:
        options["options"] = " ".join(settings)
    return options


DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'nodepool.sqlite3'}")}
DB_VENDOR = "sqlite" if "sqlite" in DATABASES["default"]["ENGINE"] else "postgresql"
if DB_VENDOR == "sqlite":
    # WAL lets readers run beside one writer; IMMEDIATE takes the write lock at BEGIN so that
    # concurrent writers queue on busy_timeout instead of failing with "database is locked"
    # when a read transaction tries to upgrade to a write (the SQLite deadlock case).
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=30000;",
        }
    )
    # A file, not :memory:, so that threads in concurrency tests share one database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test-nodepool.sqlite3")}
else:
    DATABASES["default"].setdefault("CONN_MAX_AGE", env.int("CONN_MAX_AGE", default=60))
    DATABASES["default"].setdefault("CONN_HEALTH_CHECKS", True)
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        postgres_options(
            connect_timeout=NODEPOOL_DB_CONNECT_TIMEOUT,
            statement_timeout_ms=(
                NODEPOOL_DB_STATEMENT_TIMEOUT_MS if PROCESS_KIND == "web" else NODEPOOL_DB_SWEEP_STATEMENT_TIMEOUT_MS
            ),
            jit=env.bool("NODEPOOL_DB_JIT", default=False),
            generic_plans=not DATABASES["default"].get("OPTIONS", {}).get("server_side_binding"),
            tcp_user_timeout_ms=NODEPOOL_DB_TCP_USER_TIMEOUT_MS,
        )
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Login lockout (django-axes; docs/foundation.md) -------------------------------------------
AUTHENTICATION_BACKENDS = [
    "nodepool.auth_backends.LoginLockoutBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env.int("NODEPOOL_LOGIN_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.int("NODEPOOL_LOGIN_LOCKOUT_MINUTES", default=15)) or None
# Per user and address together: a guesser cannot lock a real operator out from elsewhere.
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# Not verbose: no "AXES: BEGIN" line on every manage.py command, and lockout logs name only the
# lockout parameters (username, IP), not the user agent.
AXES_VERBOSE = False
AXES_LOCKOUT_TEMPLATE = "nodepool/login_locked_out.html"
# The per-account ceiling across addresses and the failed-authentication limit per address are
# nodepool's app settings (nodepool/conf.py: NODEPOOL_LOGIN_ACCOUNT_*, NODEPOOL_AUTH_FAILURE_*).
# Behind reverse proxies (deploy/nginx), NODEPOOL_TRUSTED_PROXIES lists their networks (CIDR,
# comma-separated): the client's address comes from X-Forwarded-For only when the immediate peer is
# one of them (nodepool.proxies, first middleware, rewrites REMOTE_ADDR for DRF's throttles, the login
# lockout and the logs alike). Empty: X-Forwarded-For is ignored and a client cannot pick its address.
NODEPOOL_TRUSTED_PROXIES = env.list("NODEPOOL_TRUSTED_PROXIES", default=[])
# Retired: NODEPOOL_PROXY_COUNT trusted the hop count whoever connected. Refuse to start with it
# rather than silently ignore it (every client behind the proxy would share the proxy's address).
if env.int("NODEPOOL_PROXY_COUNT", default=0):
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        "NODEPOOL_PROXY_COUNT is retired: set NODEPOOL_TRUSTED_PROXIES to the networks of your reverse "
        "proxies (CIDR, comma-separated) and unset NODEPOOL_PROXY_COUNT (docs/foundation.md)."
    )
AXES_CLIENT_IP_CALLABLE = "nodepool.api.throttling.client_address"
# Behind our proxy the scheme is the one it saw (it always overwrites X-Forwarded-Proto): links,
# redirects and CSRF's origin check then say https when TLS ends there. The middleware drops the
# header from any peer that is not a trusted proxy.
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if NODEPOOL_TRUSTED_PROXIES else None

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)

# --- Outbound calls (nodepool.egress) ---------------------------------------------------------------
# Destinations beyond the public internet that webhooks may reach: CIDR networks, addresses or
# exact host names, comma-separated (e.g. "10.20.0.0/16,provider.corp.example"). Empty: none.
NODEPOOL_EGRESS_ALLOW = env.list("NODEPOOL_EGRESS_ALLOW", default=[])

# --- Request limits --------------------------------------------------------------------------
# Bodies above this are refused with 413 before parsing (see nodepool.api.parsers).
NODEPOOL_MAX_BODY_BYTES = env.int("NODEPOOL_MAX_BODY_BYTES", default=256 * 1024)
NODEPOOL_MAX_JSON_DEPTH = env.int("NODEPOOL_MAX_JSON_DEPTH", default=12)
DATA_UPLOAD_MAX_MEMORY_SIZE = NODEPOOL_MAX_BODY_BYTES
# Headers above these get 431 problem+json from the app; gunicorn.conf.py lets up to twice the
# per-header limit through to it (gunicorn's own plain-text refusal only beyond that).
NODEPOOL_MAX_HEADER_BYTES = env.int("NODEPOOL_MAX_HEADER_BYTES", default=8192)
NODEPOOL_MAX_HEADERS_TOTAL_BYTES = env.int("NODEPOOL_MAX_HEADERS_TOTAL_BYTES", default=32768)

# --- User API tokens (django-rest-knox) ------------------------------------------------------------
NODEPOOL_USER_TOKEN_TTL_DAYS = env.int("NODEPOOL_USER_TOKEN_TTL_DAYS", default=90)
# An expired token's digest is kept this long, so presenting it answers reason token_expired.
NODEPOOL_EXPIRED_TOKEN_RETENTION_DAYS = env.int("NODEPOOL_EXPIRED_TOKEN_RETENTION_DAYS", default=30)
# Sliding refresh (knox's AUTO_REFRESH): each use of a token moves its expiry to now + the TTL (at
# most once a minute, one UPDATE), never past its creation + NODEPOOL_USER_TOKEN_MAX_LIFETIME_DAYS
# (which, with sliding on, also caps a new token's first expiry; 0: no maximum). Off: fixed expiry.
NODEPOOL_USER_TOKEN_SLIDING = env.bool("NODEPOOL_USER_TOKEN_SLIDING", default=False)
NODEPOOL_USER_TOKEN_MAX_LIFETIME_DAYS = env.int("NODEPOOL_USER_TOKEN_MAX_LIFETIME_DAYS", default=365)
if NODEPOOL_USER_TOKEN_SLIDING and NODEPOOL_USER_TOKEN_TTL_DAYS <= 0:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        "NODEPOOL_USER_TOKEN_SLIDING needs NODEPOOL_USER_TOKEN_TTL_DAYS > 0 (the idle lifetime each use renews)."
    )
REST_KNOX = {
    "AUTH_HEADER_PREFIX": "Token",  # the header clients and the CLI already send
    "TOKEN_PREFIX": "npu_",
    "TOKEN_TTL": timedelta(days=NODEPOOL_USER_TOKEN_TTL_DAYS) if NODEPOOL_USER_TOKEN_TTL_DAYS > 0 else None,
    "AUTO_REFRESH": NODEPOOL_USER_TOKEN_SLIDING,
    "AUTO_REFRESH_MAX_TTL": (
        timedelta(days=NODEPOOL_USER_TOKEN_MAX_LIFETIME_DAYS) if NODEPOOL_USER_TOKEN_MAX_LIFETIME_DAYS > 0 else None
    ),
    "MIN_REFRESH_INTERVAL": 60,  # seconds: a token used every second is written once a minute
}

# --- REST framework ----------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_METADATA_CLASS": "nodepool.api.metadata.Metadata",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "fleet.authentication.NodeCredentialAuthentication",
        "nodepool.api.authentication.UserTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # A signed-in user with a role; views narrow it (nodepool.api.permissions).
    "DEFAULT_PERMISSION_CLASSES": ["nodepool.api.permissions.HasRole"],
    "DEFAULT_PARSER_CLASSES": ["nodepool.api.parsers.BoundedJSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "nodepool.api.renderers.ProblemAwareJSONRenderer",
        "nodepool.api.renderers.ProblemAwareBrowsableAPIRenderer",
    ],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "nodepool.api.negotiation.ProblemAwareNegotiation",
    "DEFAULT_FILTER_BACKENDS": ["nodepool.api.filters.StrictFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "nodepool.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    "DEFAULT_THROTTLE_CLASSES": [
        "rest_framework.throttling.AnonRateThrottle",
        "nodepool.api.throttling.UserRateThrottle",  # DRF's, counted in O(1)
    ],
    # REMOTE_ADDR only: nodepool.proxies already put the client's address there.
    "NUM_PROXIES": 0,
    "DEFAULT_THROTTLE_RATES": {
        "anon": env.str("THROTTLE_ANON", default="120/min"),
        "user": env.str("THROTTLE_USER", default="100000/min"),
        "enrollment": env.str("THROTTLE_ENROLLMENT", default="600/min"),
    },
    "EXCEPTION_HANDLER": "nodepool.api.problems.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "nodepool.api.openapi.NodepoolAutoSchema",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "nodepool API",
    "DESCRIPTION": "Control plane for fleets of worker machines: nodes, pools, leases, maintenance.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Operations grouped per area (pools, enrollment, nodes, maintenance, leases…): nodepool.api.schema.
    "TAGS": API_TAGS,
    # One enum component per state machine, named after it (several models have a "state" field).
    "ENUM_NAME_OVERRIDES": {
        "LifecycleEnum": "fleet.choices.Lifecycle",
        "LivenessEnum": "fleet.choices.Liveness",
        "HealthEnum": "fleet.choices.Health",
        "CheckStatusEnum": "fleet.choices.CheckStatus",
        "BenchmarkStatusEnum": "fleet.choices.BenchmarkStatus",
        "LeaseStateEnum": "leases.choices.LeaseState",
        "WorkloadStateEnum": "leases.choices.WorkloadState",
        "LeaseRequestStateEnum": "leases.choices.LeaseRequestState",
        "DrainStateEnum": "maintenance.choices.DrainState",
        "EvictionPolicyEnum": "maintenance.choices.EvictionPolicy",
        "UsageStateEnum": "marketplace.choices.UsageState",
        "StatementStateEnum": "marketplace.choices.StatementState",
        "CheckpointStateEnum": "leases.choices.CheckpointState",
        "EvidenceCloseEnum": "leases.choices.EvidenceClose",
        "UpgradeStateEnum": "operations.choices.UpgradeState",
        "UpgradeNodeStateEnum": "operations.choices.UpgradeNodeState",
        "MachineStateEnum": "operations.choices.MachineState",
        "PreemptionStateEnum": "operations.choices.PreemptionState",
        # The lease request's operators and attributes (leases.api.spec_schema): four sets named "operator".
        "NodeSelectorOperatorEnum": "leases.spec.OPERATORS",
        "TolerationOperatorEnum": "leases.spec.TOLERATION_OPERATORS",
        "DeviceConstraintOperatorEnum": "leases.device_requests.OPERATORS",
        "NumericOperatorEnum": "nodepool.comparison.NUMERIC_OPERATORS",
        "DeviceAttributeEnum": "leases.choices.ATTRIBUTES",
        "NodeAttributeEnum": "leases.reliability.NODE_ATTRIBUTES",
    },
    # /api/docs/ must work on a control plane without internet access (and not follow "@latest").
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

CACHES = {"default": env.cache("CACHE_URL", default="locmemcache://")}
# Redis (broker, results, cache): a hung Redis fails a call within seconds instead of blocking it.
REDIS_SOCKET_TIMEOUT = env.float("NODEPOOL_REDIS_SOCKET_TIMEOUT", default=10.0)
REDIS_SOCKET_CONNECT_TIMEOUT = env.float("NODEPOOL_REDIS_SOCKET_CONNECT_TIMEOUT", default=3.0)
# The cache holds hints only (nodepool.failsafe): a Redis cache fails open, with short timeouts, and
# a failure stops this process asking Redis for NODEPOOL_CACHE_RETRY_SECONDS.
NODEPOOL_CACHE_SOCKET_TIMEOUT = env.float("NODEPOOL_CACHE_SOCKET_TIMEOUT", default=0.25)
NODEPOOL_CACHE_RETRY_SECONDS = env.float("NODEPOOL_CACHE_RETRY_SECONDS", default=2.0)
if CACHES["default"]["BACKEND"] == "django.core.cache.backends.redis.RedisCache":
    CACHES["default"]["BACKEND"] = "nodepool.failsafe.FailOpenRedisCache"
if CACHES["default"]["BACKEND"].endswith("RedisCache"):
    CACHES["default"].setdefault("OPTIONS", {}).update(
        {"socket_timeout": NODEPOOL_CACHE_SOCKET_TIMEOUT, "socket_connect_timeout": NODEPOOL_CACHE_SOCKET_TIMEOUT}
    )

# --- Celery ------------------------------------------------------------------------------------
# The embedded broker is kombu's SQLAlchemy transport on a SQLite file: it needs no server and,
# unlike the filesystem transport, never hands a worker a half-written message (see the tests in
# tests/plumbing/test_celery_worker.py, which run a real worker against it).
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default=f"sqla+sqlite:///{VAR_DIR / 'celery-broker.sqlite3'}")
CELERY_RESULT_BACKEND = env.str(
    "CELERY_RESULT_BACKEND",
    default=(
        CELERY_BROKER_URL
        if CELERY_BROKER_URL.startswith("redis")
        else f"db+sqlite:///{VAR_DIR / 'celery-results.sqlite3'}"
    ),
)
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_TASK_EAGER_PROPAGATES = True
# The queue tasks go to (and a worker started without -Q consumes); tests give each worker its own.
CELERY_TASK_DEFAULT_QUEUE = env.str("CELERY_TASK_DEFAULT_QUEUE", default="celery")
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The embedded broker's transport (nodepool.broker) polls every 0.1 s unless told otherwise here.
CELERY_BROKER_TRANSPORT_OPTIONS = env.json("CELERY_BROKER_TRANSPORT_OPTIONS", default={})
if CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    # kombu's own BRPOP wait is 1 s, well under the socket timeout.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "socket_timeout": REDIS_SOCKET_TIMEOUT,
        "socket_connect_timeout": REDIS_SOCKET_CONNECT_TIMEOUT,
        **CELERY_BROKER_TRANSPORT_OPTIONS,
    }
# Tasks sent from requests (nodepool.failsafe.publish): one attempt, and in web processes a broker
# socket that gives up within NODEPOOL_WEB_BROKER_TIMEOUT, so that a Redis outage costs a request
# at most that once per NODEPOOL_BROKER_RETRY_SECONDS (the worker keeps the longer timeouts: its
# BRPOP waits 1 s).
NODEPOOL_WEB_BROKER_TIMEOUT = env.float("NODEPOOL_WEB_BROKER_TIMEOUT", default=1.0)
NODEPOOL_BROKER_RETRY_SECONDS = env.float("NODEPOOL_BROKER_RETRY_SECONDS", default=5.0)
if PROCESS_KIND == "web" and CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        **CELERY_BROKER_TRANSPORT_OPTIONS,
        "socket_timeout": NODEPOOL_WEB_BROKER_TIMEOUT,
        "socket_connect_timeout": NODEPOOL_WEB_BROKER_TIMEOUT,
        "max_retries": 0,
    }
CELERY_REDIS_SOCKET_TIMEOUT = REDIS_SOCKET_TIMEOUT
CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = REDIS_SOCKET_CONNECT_TIMEOUT
CELERY_BEAT_SCHEDULER = "nodepool.beat:DatabaseScheduler"
CELERY_TIMEZONE = "UTC"
CELERY_TASK_TIME_LIMIT = 300

# --- nodepool ------------------------------------------------------------------------------------
# Each app declares its own settings once, typed, with its default, in <app>/conf.py
# (nodepool.appsettings): the environment variable NODEPOOL_<NAME> sets one (the names are the
# operator interface), and docs/foundation.md's "Settings" table lists them all (manage.py
# app_settings). NODEPOOL overrides them from a settings module or a test, as given.
NODEPOOL: dict = {}

# Structured logs (nodepool.structured_logs): LOG_FORMAT=json (production default) or text (make run/demo).
LOG_FORMAT = env.str("LOG_FORMAT", default="json")
# Routine periodic-task lines, applied renewals and 429s at DEBUG (nodepool.logs' filters, wired there).
LOGGING = logging_config(LOG_FORMAT, env.str("LOG_LEVEL", default="INFO"))
configure_structlog()
DJANGO_STRUCTLOG_CELERY_ENABLED = True  # tasks carry the originating request's log context
DJANGO_STRUCTLOG_STATUS_START_LOG_LEVEL = logging.DEBUG  # one line per request (request_finished)
# A task enqueued, started and succeeded is routine (issue 33: 80 % of make run's lines): DEBUG.
# Retries, failures and errors keep their levels (WARNING/ERROR).
DJANGO_STRUCTLOG_CELERY_TASK_START_LOG_LEVEL = logging.DEBUG
DJANGO_STRUCTLOG_CELERY_TASK_SUCCESS_LOG_LEVEL = logging.DEBUG
DJANGO_STRUCTLOG_IP_LOGGING_ENABLED = False  # no client addresses in logs

# Optional tracing (nodepool.tracing): OpenTelemetry's Django and Celery instrumentation, on only
# when an OTLP/HTTP traces endpoint is configured.
OTEL_EXPORTER_OTLP_ENDPOINT = env.str("OTEL_EXPORTER_OTLP_ENDPOINT", default="")
OTEL_SERVICE_NAME = env.str("OTEL_SERVICE_NAME", default="nodepool")

# /metrics (nodepool.metrics): the bearer token Prometheus sends. Default: generated once into
# var/metrics_token (Prometheus reads it with `authorization: credentials_file`).
METRICS_TOKEN = env.str("NODEPOOL_METRICS_TOKEN", default="") or _var_secret("metrics_token")

# Prometheus multiprocess mode (nodepool.metrics), on when PROMETHEUS_MULTIPROC_DIR is set (make run
# and docker-compose set it). Processes of several containers may share the directory, where pids
# repeat, so each process's files are named by hostname and pid. Set here, before any metric exists.
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    from prometheus_client import values as _prometheus_values

    _prometheus_values.ValueClass = _prometheus_values.MultiProcessValue(
        process_identifier=lambda: f"{socket.gethostname()}_{os.getpid()}"
    )

# Benchmarks only: a bare one-UPDATE view to compare heartbeats with (bench/common.py sets this).
NODEPOOL_BENCH = env.bool("NODEPOOL_BENCH", default=False)
