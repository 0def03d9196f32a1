"""nodepool-agent: the program that runs on a node and talks to the control plane over HTTP.

It depends on nothing from the Django project: only the public API (docs/api-contract.md),
httpx and psutil, so that it can be installed on a worker machine on its own.
"""

__version__ = "1.0.0"
