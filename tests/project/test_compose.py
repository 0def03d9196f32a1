"""docker-compose.yml and the Dockerfile describe the production shape and stay consistent.

``docker compose config`` validates the file where the compose plugin exists; this machine has
no container engine, so the structure is also checked here by parsing the YAML.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.processes import ROOT

COMPOSE = ROOT / "docker-compose.yml"
SERVICES = {"postgres", "redis", "migrate", "web", "proxy", "worker", "beat"}
APP_SERVICES = {"migrate", "web", "worker", "beat"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def compose_plugin_available() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not compose_plugin_available(), reason="no docker compose plugin on this machine")
def test_docker_compose_config_accepts_the_file():
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        env={
            "SECRET_KEY": "x",
            "NODEPOOL_METRICS_TOKEN": "x",
            "GRAFANA_ADMIN_PASSWORD": "x",
            "PATH": "/usr/local/bin:/usr/bin:/bin",
        },
    )
    assert result.returncode == 0, result.stderr


def test_every_service_of_the_production_shape_is_there(compose):
    always = {name for name, service in compose["services"].items() if not service.get("profiles")}
    assert always == SERVICES


def test_the_observability_profile_adds_prometheus_and_grafana_provisioned_from_deploy(compose):
    services = compose["services"]
    profiled = {name for name, service in services.items() if service.get("profiles")}
    assert profiled == {"prometheus", "grafana"}
    assert all(services[name]["profiles"] == ["observability"] for name in profiled)
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    token_file = prometheus["scrape_configs"][0]["authorization"]["credentials_file"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in services["prometheus"]["volumes"]
    assert services["prometheus"]["secrets"] == [
        {"source": "nodepool_metrics_token", "target": f"/etc/prometheus/{token_file}"}
    ]
    assert compose["secrets"]["nodepool_metrics_token"] == {"environment": "NODEPOOL_METRICS_TOKEN"}
    assert prometheus["scrape_configs"][0]["static_configs"] == [{"targets": ["web:8000"]}]
    assert prometheus["rule_files"] == ["alerts.yml"]
    grafana = services["grafana"]["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana
    assert "./deploy/grafana/nodepool.json:/var/lib/grafana/dashboards/nodepool.json:ro" in grafana


def test_app_services_share_one_multiprocess_metrics_directory(compose):
    for name in APP_SERVICES:
        service = compose["services"][name]
        assert service["environment"]["PROMETHEUS_MULTIPROC_DIR"] == "/run/nodepool-metrics", name
        assert "metrics:/run/nodepool-metrics" in service["volumes"], name
        assert re.fullmatch(r"\$\{NODEPOOL_METRICS_TOKEN:\?[^}]+\}", service["environment"]["NODEPOOL_METRICS_TOKEN"])
    assert compose["volumes"]["metrics"]["driver_opts"]["type"] == "tmpfs"


def test_every_service_has_a_healthcheck_or_says_why_not(compose):
    for name, service in compose["services"].items():
        check = service.get("healthcheck")
        if check is None:
            assert service.get("x-healthcheck-reason"), f"{name} has neither a healthcheck nor a reason"
            continue
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert {"interval", "timeout", "retries"} <= set(check), name


def test_only_the_proxy_is_published_and_web_trusts_exactly_that_one_proxy(compose):
    services = compose["services"]
    published = {name for name, service in services.items() if service.get("ports") and not service.get("profiles")}
    assert published == {"proxy"}
    proxy = services["proxy"]
    assert proxy["ports"] == ["${NODEPOOL_PORT:-8000}:8080"]
    assert proxy["environment"] == {
        "NODEPOOL_UPSTREAM": "web:8000",
        "NODEPOOL_PROBE_UPSTREAM": "web:8001",  # /healthz: gunicorn's master probe (NODEPOOL_PROBE_BIND)
        "NODEPOOL_RESOLVER": "127.0.0.11",
        "NODEPOOL_NODE_RATE_PER_ADDRESS": "${NODEPOOL_NODE_RATE_PER_ADDRESS:-200r/s}",
    }
    template = (ROOT / "deploy/nginx/nodepool.conf.template").read_text()
    assert set(re.findall(r"\$\{(\w+)\}", template)) == set(proxy["environment"])  # what envsubst fills
    assert "./deploy/nginx/nodepool.conf.template:/etc/nginx/templates/nodepool.conf.template:ro" in proxy["volumes"]
    assert (ROOT / "deploy/nginx/nodepool.conf.template").exists()
    assert proxy["depends_on"] == {"web": {"condition": "service_healthy"}}
    # The proxy's network, by address (issue 30): the subnet compose gives its default network.
    subnet = compose["networks"]["default"]["ipam"]["config"][0]["subnet"]
    assert services["web"]["environment"]["NODEPOOL_TRUSTED_PROXIES"] == subnet
    for name in APP_SERVICES:
        assert "NODEPOOL_PROXY_COUNT" not in services[name]["environment"], name


def test_web_is_healthy_only_when_readyz_says_so(compose):
    assert "/readyz" in " ".join(compose["services"]["web"]["healthcheck"]["test"])


def test_app_services_start_after_migrate_and_healthy_backends(compose):
    services = compose["services"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["restart"] == "no"
    for name in ("web", "worker", "beat"):
        depends = services[name]["depends_on"]
        assert depends["migrate"] == {"condition": "service_completed_successfully"}, name
        assert depends["postgres"] == {"condition": "service_healthy"}, name
        assert depends["redis"] == {"condition": "service_healthy"}, name


def test_app_services_use_postgres_and_redis_and_commit_no_secret(compose):
    for name in APP_SERVICES:
        env = compose["services"][name]["environment"]
        assert env["DATABASE_URL"].startswith("postgres://"), name
        assert env["CELERY_BROKER_URL"].startswith("redis://"), name
        assert re.fullmatch(r"\$\{SECRET_KEY:\?[^}]+\}", env["SECRET_KEY"]), "SECRET_KEY must come from outside"
        assert env["DEBUG"] == "false"


def test_worker_and_beat_commands_name_things_that_exist(compose):
    beat = compose["services"]["beat"]["command"]
    scheduler = beat[beat.index("--scheduler") + 1]
    module, _, cls = scheduler.partition(":")
    assert getattr(__import__(module, fromlist=[cls]), cls)
    assert compose["services"]["worker"]["command"][:4] == ["celery", "-A", "nodepool", "worker"]


def test_the_dockerfile_installs_pinned_requirements_and_serves_static_files():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install --no-cache-dir -r requirements.txt" in dockerfile
    assert "collectstatic" in dockerfile
    assert "USER nodepool" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "var"} <= set(ignored)


def test_the_image_collects_static_files_where_the_settings_serve_them_from():
    dockerfile = (ROOT / "Dockerfile").read_text()
    var_dir = re.search(r"NODEPOOL_VAR_DIR=(\S+)", dockerfile).group(1)
    assert "manage.py collectstatic --noinput" in dockerfile
    # STATIC_ROOT is <NODEPOOL_VAR_DIR>/static and whitenoise serves it; the image's user owns it.
    assert f"chown -R nodepool {var_dir}" in dockerfile
    assert dockerfile.index("collectstatic") < dockerfile.index("USER nodepool")


def test_make_run_collects_static_files_before_starting():
    plan = subprocess.run(
        ["make", "-n", "-o", "venv", "-o", "migrate", "run"], cwd=ROOT, capture_output=True, text=True
    )
    lines = plan.stdout.splitlines()
    collect = next(i for i, line in enumerate(lines) if "collectstatic --noinput" in line)
    start = next(i for i, line in enumerate(lines) if "nodepool.procfile" in line)
    assert collect < start
