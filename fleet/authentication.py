"""Node credential authentication (``Authorization: Node <secret>``).

A node credential authenticates a *node*, not a user: ``request.user`` stays anonymous and
``request.node`` is set. Views that accept node credentials use :class:`IsNodeSelf`, which also
checks that the node in the URL is the credential's own node; every other endpoint refuses a
node credential (403), because it has no user and the default permission needs one.
"""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.permissions import BasePermission

from nodepool.auth_failures import record_failure, remember_good

from . import clock
from . import secrets as node_secrets
from .choices import Lifecycle
from .credentials import CREDENTIAL_KIND, is_superseded, revoke_lineage_on_reuse
from .models import NodeCredential

KEYWORD = "Node"
KEYWORD_BYTES = KEYWORD.encode()


def node_secret(authorization: str) -> str | None:
    """The secret of ``Authorization: Node <secret>``, else None.

    Split as DRF splits every ``Authorization`` header (``rest_framework.authentication``): as
    ISO-8859-1 bytes, on ASCII whitespace only. ``str.split`` would also split on a no-break space
    (0xA0) or 0x85, which the proxy's per-credential bucket (deploy/nginx, PCRE ``\\s``) does not
    treat as a separator: a flooding node could then reach the renewal view
    (fleet.api.renewal_views, which is not DRF) outside its bucket.
    """
    try:
        parts = authorization.encode("iso-8859-1").split()
    except UnicodeEncodeError:
        return None
    if len(parts) != 2 or parts[0] != KEYWORD_BYTES:
        return None
    return parts[1].decode("iso-8859-1")


class NodeCredentialAuthentication(authentication.BaseAuthentication):
    """Authenticate ``Authorization: Node npn_<prefix>.<secret>``.

    Raises:
        AuthenticationFailed (401): unknown, expired, revoked or malformed credential; a superseded
            credential after its rotation overlap (``credential_superseded``, the lineage is revoked).
    """

    def authenticate(self, request):
        """The checks below; a refusal also counts against the client's address
        (``nodepool.auth_failures.record_failure``)."""
        try:
            return self._authenticate(request)
        except exceptions.AuthenticationFailed:
            record_failure(request)
            raise

    def _authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].decode(errors="replace") != KEYWORD:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Malformed node credential header.", "credential_malformed")
        secret = header[1].decode(errors="replace")
        prefix = node_secrets.split_prefix(secret, CREDENTIAL_KIND)
        if prefix is None:
            raise exceptions.AuthenticationFailed("Malformed node credential.", "credential_malformed")
        credential = self.find_credential(prefix)
        if credential is None or not node_secrets.matches(secret, credential.secret_hash):
            raise exceptions.AuthenticationFailed("Unknown node credential.", "credential_invalid")
        now = timezone.now()
        if credential.revoked_at is not None and credential.revoked_at <= now:
            raise exceptions.AuthenticationFailed("This node credential was revoked.", "credential_revoked")
        if credential.expires_at <= now and is_superseded(credential):
            # No grace of any kind (clock jumps included): the overlap was the grace.
            revoke_lineage_on_reuse(
                credential=credential, request_id=getattr(request._request, "request_id", ""), now=now
            )
            raise exceptions.AuthenticationFailed(
                "This node credential was replaced by a rotation and its overlap is over; every credential "
                "of this node is now revoked. Enroll again with a bootstrap token.",
                "credential_superseded",
            )
        # Judged again at control-plane time when it looks expired: a forward clock jump the
        # sweep has not noticed yet must not turn away the fleet's next heartbeats (fleet.clock).
        if credential.expires_at <= now and not clock.still_valid(credential.expires_at, now):
            raise exceptions.AuthenticationFailed(
                "This node credential expired; re-enroll or rotate sooner.", "credential_expired"
            )
        request._request.node = credential.node
        request._request.node_credential = credential
        remember_good(request.META.get("HTTP_AUTHORIZATION", ""))
        return AnonymousUser(), credential

    def find_credential(self, prefix: str) -> NodeCredential | None:
        """The credential with this lookup prefix, its node and pool loaded, or None.

        A hot endpoint may load it more cheaply (fleet.api.heartbeat_views does); the checks in
        :meth:`authenticate` stay the same for every view.
        """
        # The prefix is unique: no ORDER BY (first() would add one) for the planner to sort.
        return next(iter(self.credential_queryset().filter(prefix=prefix).order_by()[:1]), None)

    def credential_queryset(self):
        """The query that loads a credential with its node and pool."""
        return NodeCredential.objects.select_related("node", "node__pool")

    def authenticate_header(self, request):
        return KEYWORD


def credential_is_valid(credential: NodeCredential | None, now=None) -> bool:
    now = now or timezone.now()
    return bool(credential and credential.revoked_at is None and credential.expires_at > now)


class IsNodeSelf(BasePermission):
    """Allow only a node credential acting on its own node (URL kwarg ``pk`` or ``node_id``).

    A retired node is refused by the view with 410; a quarantined node's credentials are revoked.
    """

    message = "A node credential may act only on its own node."

    def has_permission(self, request, view):
        node = getattr(request._request, "node", None)
        if node is None:
            return False
        target = view.kwargs.get("pk") or view.kwargs.get("node_id")
        return target is None or str(node.pk) == str(target)


def node_from_request(request):
    """The authenticated node of a request, or None."""
    return getattr(request._request, "node", None) if hasattr(request, "_request") else getattr(request, "node", None)


__all__ = ["NodeCredentialAuthentication", "IsNodeSelf", "credential_is_valid", "node_from_request", "Lifecycle"]
