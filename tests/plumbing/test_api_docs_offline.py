"""The API docs page works on a control plane without internet access: no CDN assets."""

from __future__ import annotations

import re

from django.contrib.staticfiles import finders


def test_the_api_docs_page_loads_swagger_ui_from_our_own_static_files(client):
    response = client.get("/api/docs/")
    assert response.status_code == 200
    html = response.content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert assets, html[:500]
    assert not [a for a in assets if a.startswith(("http://", "https://", "//"))], assets
    scripts = [a for a in assets if a.endswith(".js")]
    assert scripts and all(a.startswith("/static/drf_spectacular_sidecar/") for a in scripts), scripts
    for asset in scripts:
        assert finders.find(asset.removeprefix("/static/")), asset
