"""The browser tests drive the system Chromium, not a browser Playwright downloaded."""

from __future__ import annotations

import subprocess

from tests.browser.conftest import chromium_path


def test_playwright_drives_the_system_chromium(browser):
    out = subprocess.run([chromium_path(), "--version"], capture_output=True, text=True, timeout=30).stdout
    # "Chromium 156.0.8078.108 built on Debian GNU/Linux 12 (bookworm)"
    assert browser.version in out, (browser.version, out)


def test_static_files_reach_the_browser(page):
    page.goto(f"{page.live_server_url}/admin/login/")
    color = page.evaluate("getComputedStyle(document.getElementById('header')).backgroundColor")
    # The stock admin header colour from admin/css/base.css: the stylesheet was served.
    assert color not in ("rgba(0, 0, 0, 0)", "transparent"), color
