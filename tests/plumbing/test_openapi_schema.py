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


def test_every_operation_declares_its_problem_statuses_with_the_problem_schema(db):
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            expected = {"400", "401", "403", "404", "429", "503"}
            if method != "get":
                expected |= {"409", "412", "413", "415", "428"}
            missing = expected - set(operation["responses"])
            assert not missing, (method, path, missing)
            problem = operation["responses"]["403"]["content"]["application/problem+json"]["schema"]
            assert problem == {"$ref": "#/components/schemas/Problem"}


def test_nullable_members_are_declared_nullable(db):
    from drf_spectacular.generators import SchemaGenerator

    components = SchemaGenerator().get_schema(request=None, public=True)["components"]["schemas"]
    assert components["Node"]["properties"]["owner"].get("nullable") is True
    assert components["BootstrapToken"]["properties"]["created_by"].get("nullable") is True
    assert components["FencingValidateResponse"]["properties"]["current_token"].get("nullable") is True


def test_operations_are_tagged_per_area_of_the_api(db):
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    tags = {(method, path): op["tags"] for path, ops in schema["paths"].items() for method, op in ops.items()}

    assert tags[("post", "/api/v1/nodes/{id}/drain")] == ["maintenance"]
    assert tags[("get", "/api/v1/drains")] == ["maintenance"]
    assert tags[("post", "/api/v1/nodes/{id}/heartbeats")] == ["node agent"]
    assert tags[("get", "/api/v1/nodes")] == ["nodes"]
    assert tags[("post", "/api/v1/node-leases")] == ["leases"]
    assert tags[("post", "/api/v1/node-enrollments")] == ["enrollment"]
    assert all(len(t) == 1 for t in tags.values())
    assert len({t[0] for t in tags.values()}) >= 8
    assert [t["name"] for t in schema["tags"]][:3] == ["pools", "enrollment", "admission"]


def test_a_path_of_a_new_area_is_tagged_by_its_first_segment():
    from nodepool.api.areas import area_of

    assert area_of("/api/v1/capacity/pools") == "capacity"
    assert area_of("/api/v1/") == "api"
