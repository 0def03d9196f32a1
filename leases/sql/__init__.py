"""Leases' raw SQL (leases.sql.census for now, while the package is being split up)."""

from .census import (
    candidate_page_reader,
    census_rows,
    device_fingerprint,
    hostname_in,
    next_fencing_token,
    node_gate,
    node_id_column,
    paged,
    reads_json_values_exactly,
    take_capacity,
)

__all__ = [
    "candidate_page_reader",
    "census_rows",
    "device_fingerprint",
    "hostname_in",
    "next_fencing_token",
    "node_gate",
    "node_id_column",
    "paged",
    "reads_json_values_exactly",
    "take_capacity",
]
