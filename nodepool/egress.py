"""Outbound HTTP: the one way the server calls a URL someone gave it (issue 30, item 3).

Every URL the server calls on someone's behalf (the autoscaling webhook provider, payout
webhooks) goes through :func:`request`; every such URL is checked with :func:`check_url` when it
is written. The approach is the one of ``advocate`` (Python) and Stripe's Smokescreen (Go): a
check on the *hostname* alone is bypassed by DNS, so

* at write time (:func:`check_url`): ``http``/``https`` only; no userinfo (``user@host``), no
  control bytes (CR, LF, TAB, NUL, DEL…), no spaces or backslashes; an IP literal must be in its
  canonical form (``0x7f000001``, ``2130706433``, ``127.1``, ``0177.0.0.1`` are refused: libc
  reads them as 127.0.0.1) and in an allowed range; ``localhost`` and ``*.localhost`` are refused;
* at call time (:func:`request`): the URL is checked again, the name is resolved and **every**
  address it resolves to must be allowed (one denied address refuses the call: a name that mixes
  public and private answers is an attack or a mistake);
* at connect time (:class:`_GuardedBackend`): the name is resolved once more, the socket connects
  only to an address that has just been checked, and the connected peer's address is checked
  again. A name that answers a public address to the first check and 127.0.0.1 to the second
  (DNS rebinding) is refused at the second; no later lookup exists for it to change;
* redirects are never followed (a 3xx is an error like any non-2xx), proxies from the
  environment are ignored (``trust_env=False``), the answer's size is bounded;
* a failure is described by a fixed summary (``HTTP 503 Service Unavailable``, ``timed out``,
  ``connection failed``), never by the remote side's body or its exception text, so nothing an
  internal service says can be reflected back to whoever chose the URL.

Allowed destinations: globally routable unicast addresses (``ipaddress``'s ``is_global``) that
are not multicast, checked on the IPv4 address embedded in IPv4-mapped, 6to4, Teredo and NAT64
IPv6 forms too. Everything else (loopback, private, link-local including 169.254.169.254 and
``fd00:ec2::254``, shared address space 100.64/10 including 100.100.100.200, 192.0.0.0/24
including 192.0.0.192, unspecified, reserved, multicast) is refused unless the setting
``NODEPOOL_EGRESS_ALLOW`` (a list: CIDR networks or IP addresses, and exact host names) allows it,
for operators whose provider runs inside their own network. A host name in the list allows
that name whatever it resolves to; a network allows those addresses for every name.

A maintained library would be preferable to these ~200 lines: ``advocate`` is built on
``requests`` and unmaintained since 2020, and the httpx-based packages on PyPI are young,
single-author projects; this module keeps to the standard library and the httpx/httpcore
already pinned, and its tests (tests/plumbing/test_egress.py) cover every form issue 30 lists.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx
from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Special-purpose ranges that ``is_global`` counts as global in some Python versions (3.11 does
# for all of 192.0.0.0/24, where Oracle Cloud's metadata service 192.0.0.192 lives).
SPECIAL = tuple(
    ipaddress.ip_network(n)
    for n in ("0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "198.18.0.0/15", "240.0.0.0/4", "2001:db8::/32")
)
# Characters a URL we call may not hold: C0 controls, space, DEL, backslash (parsers disagree on
# it: WHATWG reads "\" as "/", so "http://a.example\@127.0.0.1/" means different hosts to each).
_FORBIDDEN = re.compile(r"[\x00-\x20\x7f\\]")
_LEGACY_IPV4 = re.compile(r"[0-9a-fx.]+", re.IGNORECASE)
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024


class EgressError(Exception):
    """An outbound call that did not happen or did not succeed.

    ``summary`` is a fixed text (safe to store and show: never the remote body), ``status_code``
    the remote HTTP status when there was one.
    """

    code = "egress_failed"

    def __init__(self, summary: str, *, status_code: int | None = None):
        super().__init__(summary)
        self.summary = summary
        self.status_code = status_code


class EgressRefused(EgressError):
    """The URL or the address it leads to is not allowed (nothing was sent)."""

    code = "egress_refused"


@dataclass(frozen=True)
class Policy:
    """Which destinations are allowed beyond the public internet (``NODEPOOL_EGRESS_ALLOW``)."""

    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    hosts: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_settings(cls) -> Policy:
        return cls.parse(getattr(settings, "NODEPOOL_EGRESS_ALLOW", ()) or ())

    @classmethod
    def parse(cls, entries) -> Policy:
        """``["10.20.0.0/16", "::1", "provider.corp.example"]`` → Policy. Raises ValueError."""
        networks, hosts = [], set()
        for entry in entries:
            entry = str(entry).strip().lower()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if _FORBIDDEN.search(entry) or "/" in entry or ":" in entry:
                    raise ValueError(f"NODEPOOL_EGRESS_ALLOW: {entry!r} is neither a network nor a host name") from None
                hosts.add(entry.rstrip("."))
        return cls(tuple(networks), frozenset(hosts))

    def refusal(self, address: IPAddress, host: str) -> str | None:
        """Why ``address`` (reached through the name ``host``) is refused, or None if allowed."""
        if host.lower().rstrip(".") in self.hosts:
            return None
        if any(address in network for network in self.networks if network.version == address.version):
            return None
        return _category(address)


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if address.version != 6:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _category(address: IPAddress) -> str | None:
    """None for a public unicast address; otherwise what it is, in words."""
    embedded = _embedded_ipv4(address)
    if embedded is not None and _category(embedded) is not None:
        return f"an IPv6 form of a {_category(embedded).removeprefix('a ')}"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address (cloud metadata lives there)"
    if address.is_multicast:
        return "a multicast address"
    if address.is_unspecified:
        return "the unspecified address"
    if (
        address.is_private
        or not address.is_global
        or any(address in n for n in SPECIAL if n.version == address.version)
    ):
        return "a private or reserved address"
    return None


def resolve(host: str, port: int) -> list[IPAddress]:
    """The addresses ``host`` resolves to (``getaddrinfo``; tests replace this with a stub).

    Raises EgressError("name does not resolve") when it resolves to nothing.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise EgressError("name does not resolve") from None
    addresses = []
    for _family, _type, _proto, _canonname, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise EgressError("name does not resolve")
    return addresses


def checked_addresses(host: str, port: int, policy: Policy) -> list[IPAddress]:
    """Resolve ``host`` and check every address; raises EgressRefused if any is not allowed."""
    addresses = resolve(host, port)
    for address in addresses:
        reason = policy.refusal(address, host)
        if reason is not None:
            raise EgressRefused(f"destination not allowed: the host resolves to {reason}")
    return addresses


def check_url(url: Any, *, policy: Policy | None = None, destination: bool = True) -> str:
    """Check a URL at write time; returns it unchanged. Raises EgressRefused with the reason.

    Refuses: a non-string, anything but ``http``/``https``, control bytes (CR/LF…), spaces and
    backslashes, userinfo, a missing host, a bad port, ``localhost``/``*.localhost``, an IP
    literal in a non-canonical form (hex, octal, one integer, shortened dotted forms) and an IP
    literal outside the allowed destinations. Host names are not resolved here (DNS changes:
    :func:`request` resolves and checks at call time). ``destination=False`` checks the form
    only (a URL the server hands on rather than calls, e.g. the simulated provider's).
    """
    policy = policy or Policy.from_settings()
    if not isinstance(url, str) or not url:
        raise EgressRefused("must be an http(s) URL")
    if _FORBIDDEN.search(url):
        raise EgressRefused("must not contain control characters, spaces or backslashes")
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise EgressRefused("must be an http(s) URL")
    if "@" in parts.netloc:
        raise EgressRefused("must not contain user information (user@host)")
    try:
        port = parts.port
    except ValueError:
        raise EgressRefused("has an invalid port") from None
    if port == 0:
        raise EgressRefused("has an invalid port")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise EgressRefused("must name a host")
    if not destination:
        return url
    if host == "localhost" or host.endswith(".localhost"):
        raise EgressRefused("destination not allowed: localhost")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
        if _LEGACY_IPV4.fullmatch(host):
            try:
                socket.inet_aton(host)
            except OSError:
                pass
            else:
                raise EgressRefused("an IP address must be written in its canonical dotted form")
    if literal is not None:
        reason = policy.refusal(literal, host)
        if reason is not None:
            raise EgressRefused(f"destination not allowed: {reason}")
    return url


@dataclass(frozen=True)
class Response:
    """A remote answer: status, headers, and at most ``max_response_bytes`` of body."""

    status_code: int
    headers: httpx.Headers
    content: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300

    def json(self) -> Any:
        """The body as JSON, or None when it is not JSON."""
        try:
            return json.loads(self.content)
        except ValueError:
            return None

    def raise_for_status(self) -> Response:
        """Raises EgressError with :func:`describe_status` unless the status is 2xx."""
        if not self.ok:
            raise EgressError(describe_status(self.status_code), status_code=self.status_code)
        return self


def describe_status(status_code: int) -> str:
    """``HTTP 503 Service Unavailable``: the status and its standard phrase (never the body)."""
    try:
        phrase = HTTPStatus(status_code).phrase
    except ValueError:
        phrase = "Unknown Status"
    suffix = " (redirects are not followed)" if 300 <= status_code < 400 else ""
    return f"HTTP {status_code} {phrase}{suffix}"


class _GuardedBackend(httpcore.SyncBackend):
    """Connects only to an address checked just before, and checks the connected peer again."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        last_error: Exception | None = None
        for address in checked_addresses(host, port, self.policy):
            try:
                stream = super().connect_tcp(str(address), port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last_error = exc
                continue
            peer = ipaddress.ip_address(stream.get_extra_info("server_addr")[0].split("%", 1)[0])
            reason = self.policy.refusal(peer, host)
            if reason is not None:
                stream.close()
                raise EgressRefused(f"destination not allowed: connected to {reason}")
            return stream
        raise last_error or EgressError("connection failed")


class _GuardedTransport(httpx.HTTPTransport):
    def __init__(self, policy: Policy):
        super().__init__(trust_env=False)
        # httpx's transport takes no network backend; its pool does. Same pool, guarded backend.
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=1,
            max_keepalive_connections=0,
            network_backend=_GuardedBackend(policy),
        )


def request(
    method: str,
    url: str,
    *,
    content: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
) -> Response:
    """Send one request to ``url`` if its destination is allowed; returns the :class:`Response`
    whatever its status (``raise_for_status()`` for "2xx or EgressError").

    ``timeout`` (seconds) bounds connecting and each read/write. Raises EgressRefused (the URL or
    its addresses are not allowed: nothing was sent) or EgressError with a fixed summary
    (``timed out``, ``connection failed``, ``answer larger than N bytes``).
    """
    policy = Policy.from_settings()
    check_url(url, policy=policy)
    target = httpx.URL(url)
    checked_addresses(target.host, target.port or (443 if target.scheme == "https" else 80), policy)
    try:
        with (
            httpx.Client(
                transport=_GuardedTransport(policy), timeout=timeout, follow_redirects=False, trust_env=False
            ) as client,
            client.stream(method, target, content=content, headers=headers) as answer,
        ):
            body = bytearray()
            for chunk in answer.iter_bytes():
                body += chunk
                if len(body) > max_response_bytes:
                    raise EgressError(f"answer larger than {max_response_bytes} bytes", status_code=answer.status_code)
            return Response(answer.status_code, answer.headers, bytes(body))
    except EgressError:
        raise
    except httpx.TimeoutException:
        raise EgressError("timed out") from None
    except httpx.HTTPError:
        raise EgressError("connection failed") from None


def post_json(url: str, body: bytes, *, headers: dict[str, str] | None = None, timeout: float = 10.0) -> Response:
    """POST ``body`` (JSON bytes) to ``url`` through :func:`request`."""
    return request(
        "POST", url, content=body, headers={"Content-Type": "application/json", **(headers or {})}, timeout=timeout
    )
