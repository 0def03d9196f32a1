"""``manage.py create_api_token <username> [-r] [--ttl-days N]``: a hashed, expiring API token."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from nodepool.tokens import create_user_token


class Command(BaseCommand):
    help = "Create an API token for a user and print it (shown once; only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument(
            "-r", "--reset", action="store_true", help="revoke the user's other tokens first (they stop working)"
        )
        parser.add_argument("--ttl-days", type=int, default=None, help="lifetime in days (0: never expires)")

    def handle(self, *args, username, reset, ttl_days, **options):
        try:
            user = get_user_model().objects.get_by_natural_key(username)
        except get_user_model().DoesNotExist as exc:
            raise CommandError(f"No user named {username!r}.") from exc
        if ttl_days is not None and ttl_days < 0:
            raise CommandError("--ttl-days must be 0 or more.")
        ttl = "default" if ttl_days is None else (timedelta(days=ttl_days) if ttl_days else None)
        stored, key = create_user_token(user, ttl=ttl, replace=reset)
        # The first line keeps drf_create_token's wording, so scripts that parse it keep working.
        self.stdout.write(f"Generated token {key} for user {username}")
        expiry = stored.expiry.isoformat() if stored.expiry else "never"
        self.stdout.write(f"Expires: {expiry}. Send it as: Authorization: Token {key}")
