"""The API's per-user rate limit (scope ``user``, ``THROTTLE_USER``), at a cost that does not grow
with the rate.

DRF's ``UserRateThrottle`` (a ``SimpleRateThrottle``) keeps the time of every request of the
window in one cache entry, which each request reads, unpickles, extends, pickles and writes back.
At the default ``100000/min``, a scheduler granting 300 leases a second keeps 18,000 times in that
list: 160 KB, about 0.5 ms of CPU per request on this machine, and 160 KB each way to Redis.

:class:`UserRateThrottle` keeps two counters instead, the current and the previous fixed window of
the rate's duration, and estimates the sliding window as ``previous × (the share of the previous
window still inside it) + current``: the "sliding window counter" of Cloudflare's rate limiter
(blog.cloudflare.com, "How we built rate limiting capable of scaling to millions of domains",
2017). One ``get_many`` and one ``add``/``incr`` per request, whatever the rate. As in DRF, a
refused request is not counted, and two processes racing for the last request may both get it.
"""

from __future__ import annotations

from rest_framework import throttling

from nodepool.proxies import client_address_of


class UserRateThrottle(throttling.UserRateThrottle):
    """DRF's ``UserRateThrottle`` (same scope, rate setting, cache and keys: the user's id, or the
    client address when anonymous), counted as described in the module docstring.

    ``wait()`` gives the seconds until the estimate falls below the rate again if no request
    comes meanwhile (DRF's ``Retry-After``).
    """

    def allow_request(self, request, view) -> bool:
        if self.rate is None:
            return True
        self.key = self.get_cache_key(request, view)
        if self.key is None:
            return True
        self.now = self.timer()
        window, position = divmod(self.now, self.duration)
        current_key, previous_key = f"{self.key}:{int(window)}", f"{self.key}:{int(window) - 1}"
        counts = self.cache.get_many([previous_key, current_key])
        self.previous, self.current = counts.get(previous_key, 0), counts.get(current_key, 0)
        self.position = position
        if self.previous * (1 - position / self.duration) + self.current >= self.num_requests:
            return self.throttle_failure()
        # Two windows' lifetime: the next window still reads this one as its previous.
        if not self.cache.add(current_key, 1, timeout=2 * self.duration):
            try:
                self.cache.incr(current_key)
            except ValueError:  # expired between the add and the incr
                self.cache.set(current_key, 1, timeout=2 * self.duration)
        return True

    def wait(self) -> float:
        duration, limit = self.duration, self.num_requests
        if self.current < limit:
            # Within this window, as the previous window's share slides out.
            seconds = duration * (1 - (limit - self.current) / self.previous) - self.position
        else:
            # This window is full: the next one starts with it as its previous.
            seconds = duration - self.position + duration * (1 - limit / self.current)
        # The estimate must fall below the rate, not reach it: a client retrying after exactly
        # ``wait()`` seconds would be refused again.
        return max(0.0, seconds) + 0.001


def client_address(request) -> str:
    """The client's address, as every per-address limit reads it (``AXES_CLIENT_IP_CALLABLE``, the
    login lockout; DRF's throttles read the same ``REMOTE_ADDR``).

    ``nodepool.proxies.TrustedProxyMiddleware`` has already put the client's address in
    ``REMOTE_ADDR`` (from X-Forwarded-For only when the peer is in ``NODEPOOL_TRUSTED_PROXIES``);
    a request that did not pass the middleware (a test's request factory) is read the same way.
    """
    meta = request.META
    if "NODEPOOL_PEER_ADDR" in meta:
        return meta.get("REMOTE_ADDR", "")
    return client_address_of(meta)
