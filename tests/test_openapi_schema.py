"""The OpenAPI schema documents every endpoint, without warnings, and validates."""

from django.core.management import call_command


def test_the_openapi_schema_generates_without_warnings_and_validates(tmp_path, db):
    out = tmp_path / "schema.yml"
    call_command("spectacular", "--fail-on-warn", "--validate", "--file", str(out))
    text = out.read_text()
    for path in (
        "/api/v1/node-leases:",
        "/api/v1/node-leases/{id}/renew:",
        "/api/v1/node-leases/{lease_id}/events:",
        "/api/v1/fencing/validate:",
        "/api/v1/nodes/{id}/heartbeats:",
        "/api/v1/nodes/{id}/drain:",
        "/api/v1/node-enrollments:",
    ):
        assert path in text, path
