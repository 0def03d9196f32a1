"""Fleet settings, declared once (nodepool.appsettings: ``settings.NODEPOOL[NAME]``, else the
environment variable ``NODEPOOL_<NAME>``, else the default below). Read with ``conf.get(NAME)``."""

from nodepool.appsettings import AppSettings, Setting

SETTINGS = AppSettings(
    "fleet",
    Setting("CREDENTIAL_TTL", int, 24 * 3600, "a node credential's lifetime (seconds)"),
    Setting("CREDENTIAL_ROTATION_OVERLAP", int, 300,
            "how long the previous credential stays valid after a rotation (seconds)"),
    Setting("CREDENTIAL_ROTATIONS_PER_HOUR", int, 6,
            "rotations per node within any hour (an agent rotates about once a TTL; more is a loop or abuse)"),
    Setting("MAX_HEARTBEATS_PER_SECOND", float, 1000.0,
            "fleet-wide ceiling on renewals per second (Nomad's max_heartbeats_per_second); above it "
            "intervals and graces stretch (docs/heartbeats.md, Sizing)"),
    Setting("MIN_SPACING_FRACTION", float, 0.5,
            "flood guard: a node's renewals (and, separately, status reports) may not come sooner than this "
            "fraction of the interval last told (429 + Retry-After); 0 turns it off"),
    Setting("CLOCK_SKEW_THRESHOLD", float, 30.0, "a node clock this far from the server's is skewed (seconds)"),
    Setting("CLOCK_JUMP_THRESHOLD", float, 60.0,
            "a move of the server's clock between two sweeps beyond this is a detected gap that deadlines do "
            "not count (seconds; fleet.clock)"),
    Setting("UNHEALTHY_ZONE_FRACTION", float, 0.55,
            "Kubernetes' unhealthy-zone threshold: above this fraction silent, stop declaring leases lost"),
    Setting("UNHEALTHY_ZONE_MIN_NODES", int, 3,
            "...but only once at least this many nodes of the group are silent"),
    Setting("LIVENESS_SWEEP_INTERVAL", float, 5.0, "how often the liveness sweep runs (seconds)"),
    Setting("FLEET_STATE_INTERVAL", float, 15.0,
            "how often fleet.refresh_fleet_state recomputes the fleet-wide figures /metrics and the admin "
            "overview read (seconds)"),
    Setting("RELIABILITY_WINDOW_DAYS", int, 30,
            "the reliability score's window (days; fleet.reliability): completed / (completed + node-fault losses)"),
    Setting("RELIABILITY_MIN_SAMPLE", int, 10,
            "counted leases a node needs in the window before it has a score (fewer: unrated, null)"),
    Setting("RELIABILITY_RESTART_WINDOW", int, 600,
            "a lease failing this soon after a restart (new incarnation) counts as the node's fault (seconds)"),
    Setting("RELIABILITY_ROLLUP_INTERVAL", float, 900.0,
            "how often fleet.rollup_reliability rewrites today's and yesterday's rows and the scores (seconds)"),
    Setting("RELIABILITY_RETENTION_DAYS", int, 400,
            "daily reliability rows older than this are deleted by the rollup (days; they outlive the events)"),
    Setting("METRICS_RATE", str, "12/min", "detailed metrics (POST /nodes/{id}/metrics): rate per node"),
    Setting("METRICS_MAX_BODY_BYTES", int, 128 * 1024, "detailed metrics: largest body (bytes)"),
)  # fmt: skip

get = SETTINGS.get
