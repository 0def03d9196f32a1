"""nodepoolctl: a kubectl-style command line for nodepool's public API (a thin httpx client, no ORM).

See docs/nodepoolctl.md. Entry point: ``nodepoolctl`` (pyproject ``[project.scripts]``), or
``python -m nodepoolctl``.
"""
