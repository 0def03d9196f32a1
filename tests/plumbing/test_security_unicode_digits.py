"""Non-ASCII digits on every entry point that parses a number with ``isdigit()``.

``"²".isdigit()`` is True but ``int("²")`` raises: each guard is ``isascii() and isdigit()`` now, so
the caller gets a 400 problem (API), a form error (admin), or the value is ignored (imports), never
a 500. ``"٣"`` (Arabic-Indic three) passes ``isdigit()`` *and* ``int()``: refused the same way.
"""

from __future__ import annotations

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME

from fleet.k8s_import import map_node
from fleet.models import Node
from maintenance.models import Drain
from tests.factories import PoolFactory, make_schedulable_node
from tests.problems import assert_problem

pytestmark = pytest.mark.django_db
NOT_ASCII = ["²", "١", "٣٠", "7²"]


@pytest.mark.parametrize("days", NOT_ASCII)
def test_pool_preemptions_refuse_non_ascii_days_with_a_400(operator_api, days):
    PoolFactory(name="spot")
    response = operator_api.get("/api/v1/pools/spot/preemptions", {"days": days})
    assert_problem(response, 400, "invalid_days")


def test_pool_preemptions_still_take_ascii_days(operator_api):
    PoolFactory(name="spot")
    response = operator_api.get("/api/v1/pools/spot/preemptions", {"days": "3"})
    assert response.status_code == 200, response.json()


@pytest.mark.parametrize("declared", ["²", "¹²"])
def test_a_content_length_of_latin1_superscripts_is_a_400(operator_api, declared):
    # WSGI decodes headers as latin-1: the byte 0xB2 arrives as "²".
    response = operator_api.post("/api/v1/pools", {"name": "x"}, format="json", CONTENT_LENGTH=declared)
    assert_problem(response, 400, "invalid_content_length")


CHANGELIST = "/admin/fleet/node/"


def _drain_form(client, node, version: str, **fields):
    data = {"action": "drain_nodes", ACTION_CHECKBOX_NAME: [str(node.pk)], f"version_{node.pk}": version,
            "reason": "kernel update", "policy": "checkpoint", "deadline_in": "2", "deadline_unit": "hours",
            **fields}  # fmt: skip
    return client.post(CHANGELIST, data, follow=True)


@pytest.mark.parametrize("version", ["²", "١"])
@pytest.mark.parametrize("button", ["apply", "preview"])
def test_the_admin_action_form_and_preview_report_a_non_ascii_version_and_change_nothing(admin_client, version, button):
    node, _ = make_schedulable_node()
    response = _drain_form(admin_client, node, version, **{button: "1"})
    assert response.status_code == 200
    assert b"no version was read" in response.content
    assert not Drain.objects.exists()
    assert Node.objects.get(pk=node.pk).lifecycle == "ready"


def test_the_admin_action_still_runs_with_an_ascii_version(admin_client):
    node, _ = make_schedulable_node()
    _drain_form(admin_client, node, str(node.version), apply="1")
    assert Drain.objects.filter(node=node).exists()


def test_a_kubernetes_import_ignores_non_ascii_gpu_numbers():
    mapped = map_node(
        {
            "metadata": {
                "uid": "u-1",
                "name": "gpu-1",
                "labels": {"nvidia.com/gpu.product": "A100", "nvidia.com/gpu.memory": "²", "nvidia.com/gpu.count": "²"},
            },
            "status": {"capacity": {"nvidia.com/gpu": "1"}, "allocatable": {"nvidia.com/gpu": "1"}},
        }
    )
    [accelerator] = mapped.fields["declared"]["accelerators"]
    assert accelerator["memory"] == 0 and accelerator["count"] == 1


def test_the_json_parser_ignores_a_non_ascii_declared_length():
    import io
    from types import SimpleNamespace

    from nodepool.api.parsers import BoundedJSONParser

    request = SimpleNamespace(META={"CONTENT_LENGTH": "²"})
    parsed = BoundedJSONParser().parse(io.BytesIO(b'{"a": 1}'), parser_context={"request": request})
    assert parsed == {"a": 1}
