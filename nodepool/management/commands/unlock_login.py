"""``manage.py unlock_login <username> [--ip ADDRESS]``: lift a login lockout (django-axes) and,
without ``--ip``, the account's ceiling of failures across addresses (nodepool.auth_failures)."""

from __future__ import annotations

from axes.utils import reset
from django.core.management.base import BaseCommand

from nodepool.auth_failures import LOGIN, forget


class Command(BaseCommand):
    help = "Unlock a user's login after too many failed attempts (all addresses, or one with --ip)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--ip", default=None, help="only the lockout from this address")

    def handle(self, *args, username, ip, **options):
        count = reset(username=username, ip=ip) if ip else reset(username=username)
        windows = 0 if ip else forget(LOGIN, username)
        self.stdout.write(
            f"Unlocked {username}: {count} failed-login record(s) removed, {windows} account window(s) cleared."
        )
