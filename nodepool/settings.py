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

import os
import secrets
import tempfile
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(environ.Env().str("NODEPOOL_VAR_DIR", default=str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

env = environ.Env(
    DEBUG=(bool, False),
    ALLOWED_HOSTS=(list, ["localhost", "127.0.0.1", "[::1]", "testserver"]),
)


def _secret_key() -> str:
    """The SECRET_KEY from the environment, or one generated once into var/secret_key (0600).

    Several processes start at once (gunicorn workers, Celery worker and beat), so the key file
    is published atomically: written to a private temporary file, then hard-linked into place,
    which fails if another process got there first. Every process then reads the one winner.
    """
    if env.str("SECRET_KEY", default=""):
        return env.str("SECRET_KEY")
    path = VAR_DIR / "secret_key"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=VAR_DIR, prefix=".secret_key.")  # created 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(50))
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env("DEBUG")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI served from our static files, not a CDN
    "django_celery_beat",
    "nodepool.apps.NodepoolConfig",
    "fleet",
    "leases",
    "maintenance",
]

MIDDLEWARE = [
    "nodepool.api.middleware.RequestIdMiddleware",
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
]

ROOT_URLCONF = "nodepool.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

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

# --- Request limits --------------------------------------------------------------------------
# Bodies above this are refused with 413 before parsing (see nodepool.api.parsers).
NODEPOOL_MAX_BODY_BYTES = env.int("NODEPOOL_MAX_BODY_BYTES", default=256 * 1024)
NODEPOOL_MAX_JSON_DEPTH = env.int("NODEPOOL_MAX_JSON_DEPTH", default=12)
DATA_UPLOAD_MAX_MEMORY_SIZE = NODEPOOL_MAX_BODY_BYTES

# --- REST framework ----------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "fleet.authentication.NodeCredentialAuthentication",
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["nodepool.api.parsers.BoundedJSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "nodepool.api.renderers.ProblemAwareJSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "nodepool.api.negotiation.ProblemAwareNegotiation",
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "nodepool.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    "DEFAULT_THROTTLE_CLASSES": [
        "rest_framework.throttling.AnonRateThrottle",
        "rest_framework.throttling.UserRateThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": {
        "anon": env.str("THROTTLE_ANON", default="120/min"),
        "user": env.str("THROTTLE_USER", default="100000/min"),
        "enrollment": env.str("THROTTLE_ENROLLMENT", default="600/min"),
    },
    "EXCEPTION_HANDLER": "nodepool.api.problems.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "nodepool API",
    "DESCRIPTION": "Control plane for fleets of worker machines: nodes, pools, leases, maintenance.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
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
    },
    # /api/docs/ must work on a control plane without internet access (and not follow "@latest").
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

CACHES = {"default": env.cache("CACHE_URL", default="locmemcache://")}

# --- Celery ------------------------------------------------------------------------------------
# The embedded broker is kombu's SQLAlchemy transport on a SQLite file: it needs no server and,
# unlike the filesystem transport, never hands a worker a half-written message (see the tests in
# tests/test_celery_worker.py, which run a real worker against it).
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
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The embedded broker's transport (nodepool.broker) polls every 0.1 s unless told otherwise here.
CELERY_BROKER_TRANSPORT_OPTIONS = env.json("CELERY_BROKER_TRANSPORT_OPTIONS", default={})
CELERY_BEAT_SCHEDULER = "nodepool.beat:DatabaseScheduler"
CELERY_TIMEZONE = "UTC"
CELERY_TASK_TIME_LIMIT = 300

# --- nodepool ------------------------------------------------------------------------------------
NODEPOOL = {
    # Node credentials (seconds).
    "CREDENTIAL_TTL": env.int("NODEPOOL_CREDENTIAL_TTL", default=24 * 3600),
    "CREDENTIAL_ROTATION_OVERLAP": env.int("NODEPOOL_CREDENTIAL_ROTATION_OVERLAP", default=300),
    # Heartbeats: the fleet-wide ceiling on heartbeats per second (Nomad's max_heartbeats_per_second).
    "MAX_HEARTBEATS_PER_SECOND": env.float("NODEPOOL_MAX_HEARTBEATS_PER_SECOND", default=50.0),
    "CLOCK_SKEW_THRESHOLD": env.float("NODEPOOL_CLOCK_SKEW_THRESHOLD", default=30.0),
    # Kubernetes' unhealthy-zone threshold: above this fraction silent, stop declaring leases lost.
    "UNHEALTHY_ZONE_FRACTION": env.float("NODEPOOL_UNHEALTHY_ZONE_FRACTION", default=0.55),
    # ...but only once at least this many nodes of the group are silent (a lone node's pool may lose it).
    "UNHEALTHY_ZONE_MIN_NODES": env.int("NODEPOOL_UNHEALTHY_ZONE_MIN_NODES", default=3),
    # How often the liveness sweep runs (seconds); its beat entry expires sooner.
    "LIVENESS_SWEEP_INTERVAL": env.float("NODEPOOL_LIVENESS_SWEEP_INTERVAL", default=5.0),
    # Detailed metrics (POST /nodes/{id}/metrics): per-node rate and size limits.
    "METRICS_RATE": env.str("NODEPOOL_METRICS_RATE", default="12/min"),
    "METRICS_MAX_BODY_BYTES": env.int("NODEPOOL_METRICS_MAX_BODY_BYTES", default=128 * 1024),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}

# Benchmarks only: a bare one-UPDATE view to compare heartbeats with (bench/common.py sets this).
NODEPOOL_BENCH = env.bool("NODEPOOL_BENCH", default=False)
