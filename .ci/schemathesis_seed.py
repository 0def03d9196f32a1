"""Fixtures for one schemathesis run (run by .ci/schemathesis.py through ``manage.py shell``):
an operator, a marketplace owner with a node, that node's credential, and a lease. Prints JSON."""

import json
from datetime import timedelta

from django.contrib.auth.models import Group, User
from django.utils import timezone

from fleet.models import Pool
from fleet.services import bootstrap_token_create, node_enroll
from nodepool.api.permissions import CLIENTS, OPERATORS, OWNERS
from nodepool.tokens import create_user_token


def user(name, *groups, superuser=False):
    account = User.objects.create_user(name, password=None, is_superuser=superuser, is_staff=superuser)
    for group in groups:
        account.groups.add(Group.objects.get_or_create(name=group)[0])
    return create_user_token(account)[1], account


operator_token, _ = user("st-operator", OPERATORS, CLIENTS, superuser=True)
owner_token, owner = user("st-owner", OWNERS)
pool = Pool.objects.create(name="general", admission_mode="automatic")
_, secret = bootstrap_token_create(pool=pool, expires_at=timezone.now() + timedelta(hours=1), max_uses=2, owner=owner)
capability = {"resources": {"cpu": "8", "memory": "16Gi"}, "features": {"arch": "amd64", "os": "linux"}}
node, _, credential = node_enroll(
    bootstrap_token=secret, hostname="st-node", agent_version="1.0.0", capability=capability, labels={}
)
print(json.dumps({"operator": operator_token, "owner": owner_token, "node": credential, "node_id": str(node.pk)}))
