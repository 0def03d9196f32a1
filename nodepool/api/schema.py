"""OpenAPI (drf-spectacular) extensions for nodepool's own authentication schemes."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema

from .areas import area_of


class NodeCredentialScheme(OpenApiAuthenticationExtension):
    target_class = "fleet.authentication.NodeCredentialAuthentication"
    name = "nodeCredential"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "Node credential: `Authorization: Node npn_<prefix>.<secret>`",
        }


class UserTokenScheme(OpenApiAuthenticationExtension):
    target_class = "nodepool.api.authentication.UserTokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "User API token (hashed, expiring): `Authorization: Token <key>` "
            "(`manage.py create_api_token <username>`)",
        }


class AreaAutoSchema(AutoSchema):
    """drf-spectacular's AutoSchema, tagging each operation with its area (nodepool.api.areas;
    an explicit ``@extend_schema(tags=...)`` still wins)."""

    def get_tags(self) -> list[str]:
        return [area_of(self.path)]
