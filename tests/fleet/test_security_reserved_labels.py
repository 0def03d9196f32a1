"""Labels a node may set on itself follow Kubernetes' NodeRestriction (issue 11, item 8)."""

from __future__ import annotations

import pytest

from fleet.k8s_import import map_node
from fleet.labels import node_may_set
from fleet.models import BootstrapToken, Node
from tests.fleet_support import enroll, fresh_throttles, make_pool, make_token  # noqa: F401
from tests.problems import assert_problem

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fresh_throttles")]


@pytest.fixture
def token():
    return make_token(make_pool(name="general"), max_uses=10)


@pytest.mark.parametrize(
    "key",
    [
        "node-role.kubernetes.io/control-plane",
        "kubernetes.io/role",
        "example.kubernetes.io/x",
        "k8s.io/anything",
        "sub.k8s.io/anything",
        "node-restriction.kubernetes.io/trusted",
        "x.node-restriction.kubernetes.io/trusted",
        "nodepool.dev/node-id",
        "nodepool.dev/pool",
        "team.nodepool.dev/owner",
    ],
)
def test_a_node_may_not_enroll_with_a_reserved_label_key(anon_api, token, key):
    uses = BootstrapToken.objects.get().uses

    response = enroll(anon_api, token, labels={key: "x"})

    body = assert_problem(response, 400, "reserved_label")
    assert body["errors"][0]["field"] == f"labels.{key}"
    assert not Node.objects.exists() and BootstrapToken.objects.get().uses == uses


@pytest.mark.parametrize(
    "key",
    [
        "kubernetes.io/arch",
        "kubernetes.io/os",
        "beta.kubernetes.io/instance-type",
        "node.kubernetes.io/instance-type",
        "topology.kubernetes.io/region",
        "topology.kubernetes.io/zone",
        "failure-domain.beta.kubernetes.io/zone",
        "kubelet.kubernetes.io/anything",
        "x.kubelet.kubernetes.io/anything",
        "node.kubernetes.io/anything",
        "example.com/team",
        "zone",
    ],
)
def test_a_node_may_set_the_kubelets_allowed_labels_and_its_own(anon_api, token, key):
    response = enroll(anon_api, token, labels={key: "x"})

    assert response.status_code == 201, response.json()
    assert Node.objects.get().node_labels == {key: "x"}


def test_the_hostname_label_must_equal_the_nodes_hostname(anon_api, token):
    wrong = enroll(anon_api, token, hostname="h1.example.test", labels={"kubernetes.io/hostname": "h2"})
    right = enroll(anon_api, token, hostname="h1", labels={"kubernetes.io/hostname": "h1"})

    assert_problem(wrong, 400, "reserved_label")
    assert right.status_code == 201


def test_the_kubernetes_importer_and_operators_may_set_reserved_labels():
    mapped = map_node(
        {
            "metadata": {
                "name": "n1",
                "uid": "u1",
                "labels": {"node-role.kubernetes.io/worker": "", "nodepool.dev/x": "y"},
            }
        }
    )

    assert not node_may_set("node-role.kubernetes.io/worker")
    assert "node-role.kubernetes.io/worker" in str(mapped.fields)


def test_operators_may_set_reserved_label_keys_as_pool_labels(operator_api):
    make_pool(name="edge")

    response = operator_api.patch(
        "/api/v1/pools/edge", {"labels": {"node-role.kubernetes.io/edge": "true"}}, format="json", HTTP_IF_MATCH='"1"'
    )

    assert response.status_code == 200, response.json()
    assert response.json()["labels"] == {"node-role.kubernetes.io/edge": "true"}
