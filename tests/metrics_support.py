"""Reading /metrics in tests: scrape with the token, parse the exposition, look samples up."""

from __future__ import annotations

from django.conf import settings
from prometheus_client.parser import text_string_to_metric_families

from nodepool.metrics import FLEET_STATE


def scrape(client) -> str:
    """One scrape of /metrics with the scrape token, the fleet-state cache emptied first."""
    FLEET_STATE.invalidate()
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.METRICS_TOKEN}")
    assert response.status_code == 200, response.content[:500]
    return response.content.decode()


def samples(text: str) -> dict[tuple, float]:
    """``{(sample name, frozenset of label items): value}`` for every sample of the exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(text_or_samples, name: str, **labels) -> float | None:
    """The sample ``name{labels}`` (exact label set), or None when it is not exported."""
    found = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    return found.get((name, frozenset((k, str(v)) for k, v in labels.items())))


def exported_names(text: str) -> set[str]:
    """Every metric family and sample name the exposition carries (HELP/TYPE lines included)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            names.add(line.split()[2])
    return names
