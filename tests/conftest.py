"""Shared fixtures: the cast of users (operator, owner, client) and API clients for each."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, User
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from nodepool.api.permissions import CLIENTS, OPERATORS, OWNERS


@pytest.fixture(autouse=True)
def _eager_celery(settings):
    """Unit tests run tasks inline; tests/test_celery_worker.py starts real workers instead."""
    from nodepool.celery import app

    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    yield
    app.conf.task_always_eager = False


def _user(username: str, group: str | None) -> User:
    user = User.objects.create_user(username=username, password="pw-" + username)
    if group:
        user.groups.add(Group.objects.get_or_create(name=group)[0])
    return user


@pytest.fixture
def operator(db) -> User:
    return _user("olivia-operator", OPERATORS)


@pytest.fixture
def owner(db) -> User:
    return _user("oscar-owner", OWNERS)


@pytest.fixture
def other_owner(db) -> User:
    return _user("otto-other-owner", OWNERS)


@pytest.fixture
def client_user(db) -> User:
    return _user("carla-client", CLIENTS)


def _api(user: User | None) -> APIClient:
    api = APIClient()
    if user is not None:
        token, _ = Token.objects.get_or_create(user=user)
        api.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return api


@pytest.fixture
def anon_api() -> APIClient:
    return APIClient()


@pytest.fixture
def operator_api(operator) -> APIClient:
    return _api(operator)


@pytest.fixture
def owner_api(owner) -> APIClient:
    return _api(owner)


@pytest.fixture
def client_api(client_user) -> APIClient:
    return _api(client_user)
