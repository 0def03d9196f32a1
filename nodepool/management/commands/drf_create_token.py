"""``manage.py drf_create_token``: the old name of ``create_api_token`` (same arguments, hashed
tokens). Django REST framework's own command made plaintext tokens; nodepool no longer installs it."""

from .create_api_token import Command as CreateApiToken


class Command(CreateApiToken):
    help = "Alias of create_api_token: " + CreateApiToken.help
