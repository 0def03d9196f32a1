"""Move Django REST framework's plaintext user tokens to knox's hashed, expiring tokens.

Each ``authtoken_token`` key becomes a knox ``AuthToken`` with the SHA-512 digest of the same key
(so clients keep sending the same ``Authorization: Token <key>``) and the default lifetime from
now; then the plaintext rows are deleted. The table belongs to ``rest_framework.authtoken``, which
is no longer installed, so it is read with SQL and only when it exists.
"""

from datetime import timedelta

from django.conf import settings
from django.db import migrations
from django.utils import timezone


def forwards(apps, schema_editor):
    connection = schema_editor.connection
    if "authtoken_token" not in connection.introspection.table_names():
        return
    from knox.crypto import hash_token
    from knox.settings import CONSTANTS

    AuthToken = apps.get_model("knox", "AuthToken")
    days = settings.NODEPOOL_USER_TOKEN_TTL_DAYS
    expiry = timezone.now() + timedelta(days=days) if days > 0 else None
    with connection.cursor() as cursor:
        cursor.execute("SELECT key, user_id FROM authtoken_token")
        rows = cursor.fetchall()
    AuthToken.objects.bulk_create(
        [
            AuthToken(digest=hash_token(key), token_key=key[: CONSTANTS.TOKEN_KEY_LENGTH], user_id=user_id, expiry=expiry)
            for key, user_id in rows
        ],
        ignore_conflicts=True,
    )
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM authtoken_token")


class Migration(migrations.Migration):
    dependencies = [("knox", "0009_extend_authtoken_field"), migrations.swappable_dependency(settings.AUTH_USER_MODEL)]
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
