"""humanunits: the one way amounts and times are written for people (issue 33, item 4)."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from humanunits import age, duration, moment, percent, quantity, resources, timestamp
from nodepool.quantity import to_canonical

GiB = 2**30
NOW = datetime(2026, 12, 2, 9, 48, 53, tzinfo=UTC)


@pytest.mark.parametrize(
    ("resource", "canonical", "text"),
    [
        ("cpu", 32000, "32"),
        ("cpu", 2100, "2.1"),
        ("cpu", 2150, "2150m"),
        ("cpu", 1488, "1488m"),
        ("cpu", 250, "250m"),
        ("cpu", 0, "0"),
        ("memory", 16 * GiB, "16Gi"),
        ("memory", 2040109466, "1.9Gi"),
        ("memory", 5105350390, "4.8Gi"),
        ("memory", 6085452932 * 1024, "5.7Ti"),
        ("memory", 512 * 2**20, "512Mi"),
        ("memory", 900, "900"),
        ("memory", 2**20 - 1, "1Mi"),
        ("ephemeral-storage", 100 * GiB, "100Gi"),
        ("nvidia.com/gpu", 8, "8"),
        ("cpu", None, "-"),
    ],
)
def test_quantities_are_written_the_kubernetes_way(resource, canonical, text):
    assert quantity(resource, canonical) == text


@given(st.integers(min_value=0, max_value=2**50))
def test_cpu_is_exact_and_parses_back_to_the_same_millicores(millicores):
    assert to_canonical("cpu", quantity("cpu", millicores)) == millicores


@given(st.integers(min_value=1024, max_value=2**62))
def test_bytes_are_within_five_hundredths_of_a_unit(amount):
    text = quantity("memory", amount)
    assert abs(_bytes(text) - amount) <= 0.050001 * _unit(text)  # half a tenth, plus float noise


def _unit(text: str) -> int:
    return {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}[text[-2:]]


def _bytes(text: str) -> float:
    return float(text[:-2]) * _unit(text)


def test_a_mapping_of_resources_reads_as_one_line():
    assert resources({"memory": 2 * GiB, "cpu": 2100}) == "cpu=2.1, memory=2Gi"
    assert resources({}) == "-"


def test_one_absolute_time_format_and_a_kubectl_age():
    then = NOW - timedelta(minutes=12, seconds=5)
    assert timestamp(then) == "2026-12-02 09:36:48 UTC"
    assert timestamp("2026-12-02T09:36:48.123456Z") == "2026-12-02 09:36:48 UTC"
    assert age(then, NOW) == "12m"
    assert moment(then, NOW) == "2026-12-02 09:36:48 UTC (12m ago)"
    assert moment(None) == "never"
    assert age(None) == "<none>"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "0s"),
        (45, "45s"),
        (119, "119s"),
        (330, "5m30s"),
        (600, "10m"),
        (42 * 60, "42m"),
        (3 * 3600 + 12 * 60, "3h12m"),
        (20 * 3600, "20h"),
        (3 * 86400 + 4 * 3600, "3d4h"),
        (200 * 86400, "200d"),
        (3 * 365 * 86400 + 20 * 86400, "3y20d"),
        (12 * 365 * 86400, "12y"),
    ],
)
def test_durations_follow_kubectls_human_duration(seconds, text):
    assert duration(seconds) == text


def test_percent():
    assert percent(5105350390, 17179869184) == "30%"
    assert percent(1, 0) == "-"


def test_the_cli_gets_the_module_without_loading_the_server():
    """nodepoolctl talks over HTTP only: importing its renderer must not import nodepool (Celery, Django)."""
    code = "import sys, nodepoolctl.render, nodepoolctl.cli; assert 'nodepool' not in sys.modules, 'server loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
