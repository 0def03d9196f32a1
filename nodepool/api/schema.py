"""OpenAPI (drf-spectacular) extensions for nodepool's own authentication schemes."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


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
