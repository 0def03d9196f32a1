"""Maintenance: filled by the maintenance issue."""
