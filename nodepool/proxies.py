"""The client's address, from X-Forwarded-For only when the peer is a trusted proxy (issue 30, item 4).

``NODEPOOL_TRUSTED_PROXIES`` lists the networks of our own reverse proxies (compose: its network).
:class:`TrustedProxyMiddleware`, first in ``MIDDLEWARE``, rewrites ``REMOTE_ADDR`` once per
request, so DRF's throttles (``NUM_PROXIES`` 0: they read ``REMOTE_ADDR``), the login lockout
(``AXES_CLIENT_IP_CALLABLE``), the failed-authentication limits and the logs all read one address:

* the immediate peer is not a trusted proxy → the peer is the client; its ``X-Forwarded-For`` and
  ``X-Forwarded-Proto`` are dropped (a client that reaches gunicorn directly cannot choose its
  address or scheme);
* the peer is trusted → walk ``X-Forwarded-For`` from the right, skipping trusted proxies; the first
  address that is not one is the client (the "rightmost untrusted" rule of nginx's realip module
  with ``real_ip_recursive on``). An entry that is not an IP address stops the walk at the last
  good one.

The peer stays in ``request.META["NODEPOOL_PEER_ADDR"]``. This replaces ``NODEPOOL_PROXY_COUNT`` (a
hop count, trusted whoever connected), retired: settings refuse to start while it is set non-zero.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache

from django.conf import settings

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@lru_cache(maxsize=8)
def _networks(entries: tuple[str, ...]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(entry.strip(), strict=False) for entry in entries if entry.strip())


def trusted_networks() -> tuple[Network, ...]:
    return _networks(tuple(getattr(settings, "NODEPOOL_TRUSTED_PROXIES", ()) or ()))


def _ip(value: str):
    try:
        return ipaddress.ip_address(value.strip().strip("[]"))
    except ValueError:
        return None


def _trusted(address, networks) -> bool:
    return address is not None and any(address in network for network in networks if network.version == address.version)


def client_address_of(meta: dict, networks: tuple[Network, ...] | None = None) -> str:
    """The client's address for a request's ``META`` (see the module docstring)."""
    networks = trusted_networks() if networks is None else networks
    peer = meta.get("REMOTE_ADDR", "")
    if not _trusted(_ip(peer), networks):
        return peer
    address = peer
    for entry in reversed(meta.get("HTTP_X_FORWARDED_FOR", "").split(",")):
        ip = _ip(entry)
        if ip is None:
            break
        address = str(ip)
        if not _trusted(ip, networks):
            break
    return address


class TrustedProxyMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        meta = request.META
        peer = meta.get("REMOTE_ADDR", "")
        meta["NODEPOOL_PEER_ADDR"] = peer
        networks = trusted_networks()
        if _trusted(_ip(peer), networks):
            meta["REMOTE_ADDR"] = client_address_of(meta, networks)
        else:
            meta.pop("HTTP_X_FORWARDED_FOR", None)
            meta.pop("HTTP_X_FORWARDED_PROTO", None)
        return self.get_response(request)
