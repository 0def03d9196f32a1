"""Leases: filled by the leases issue."""
