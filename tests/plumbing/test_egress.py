"""Outbound calls go only where allowed (issue 30, item 3; nodepool.egress).

Every form the security trial used against the autoscaling webhook URL is refused when written
and again when called; names are resolved through a stub (metadata.google.internal does not
resolve here) and checked after resolution and again at connect time; redirects are not
followed; a remote error is recorded as its status and a fixed phrase, never its body.
"""

from __future__ import annotations

import pytest

from nodepool import egress
from tests.egress_support import Receiver, allow_loopback, stub_dns

TRIAL_FORMS = [
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://127.0.0.1:5432/",
    "http://localhost:6379/",
    "http://[::1]/",
    "http://0x7f000001/",
    "http://2130706433/",
    "http://127.1/",
    "http://user@127.0.0.1/",
    "http://10.0.0.1/",
    "http://provider.example/scale\r\nX-Injected: 1",
    "http://provider.example/scale\n",
]
MORE_FORMS = [
    "ftp://provider.example/",
    "file:///etc/passwd",
    "http://0177.0.0.1/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:169.254.169.254]/",
    "http://[fd00:ec2::254]/",
    "http://[64:ff9b::a9fe:a9fe]/",
    "http://100.100.100.200/",
    "http://192.0.0.192/",
    "http://192.168.1.1/",
    "http://172.16.0.1/",
    "http://224.0.0.1/",
    "http://0.0.0.0/",
    "http://app.localhost/",
    "http://provider.example\\@127.0.0.1/",
    "http://provider.example:99999/",
    "http://user:pass@provider.example/",
    "http://provider.example/\x7f",
]


@pytest.mark.parametrize("url", TRIAL_FORMS + MORE_FORMS)
def test_every_form_of_an_internal_or_malformed_destination_is_refused_when_written(url):
    with pytest.raises(egress.EgressRefused):
        egress.check_url(url)


@pytest.mark.parametrize("url", TRIAL_FORMS + MORE_FORMS)
def test_every_form_is_refused_again_when_called_and_nothing_is_sent(url, monkeypatch):
    stub_dns(monkeypatch, {"provider.example": ["93.184.216.34"]})
    with pytest.raises(egress.EgressRefused):
        egress.request("POST", url, content=b"{}")


def test_public_destinations_are_allowed():
    assert egress.check_url("https://hooks.provider.example/scale?x=1") == "https://hooks.provider.example/scale?x=1"
    assert egress.check_url("http://93.184.216.34:8080/") == "http://93.184.216.34:8080/"
    assert egress.check_url("http://[2606:4700::1111]/")


def test_a_name_resolving_to_the_metadata_service_is_refused_after_resolution(monkeypatch):
    lookups = stub_dns(monkeypatch, {"metadata.google.internal": ["169.254.169.254"]})
    assert egress.check_url("http://metadata.google.internal/computeMetadata/v1/")  # a name: DNS decides
    with pytest.raises(egress.EgressRefused, match="link-local"):
        egress.request("GET", "http://metadata.google.internal/computeMetadata/v1/")
    assert lookups == ["metadata.google.internal"]


def test_a_name_with_one_private_answer_among_public_ones_is_refused(monkeypatch):
    stub_dns(monkeypatch, {"mixed.example": ["93.184.216.34", "10.0.0.7"]})
    with pytest.raises(egress.EgressRefused, match="private"):
        egress.request("POST", "http://mixed.example/")


def test_a_name_rebinding_to_loopback_between_check_and_connect_is_refused_at_connect(monkeypatch, settings):
    receiver = Receiver()
    try:
        # First lookup (the call-time check): public. Second (the connect): the receiver on loopback.
        lookups = stub_dns(monkeypatch, {"rebind.example": [["93.184.216.34"], ["127.0.0.1"]]})
        with pytest.raises(egress.EgressRefused, match="loopback"):
            egress.request("POST", f"http://rebind.example:{receiver.port}/hook", content=b"{}")
        assert lookups == ["rebind.example", "rebind.example"]
        assert receiver.requests == []
    finally:
        receiver.close()


def test_an_allowlisted_loopback_receiver_is_called_and_its_answer_read(settings):
    allow_loopback(settings)
    receiver = Receiver(body=b'{"machines": {}}')
    try:
        answer = egress.post_json(receiver.url, b'{"a":1}', headers={"X-Test": "1"}).raise_for_status()
    finally:
        receiver.close()
    assert answer.json() == {"machines": {}}
    assert receiver.requests == [("POST", "/hook", b'{"a":1}')]


def test_the_allowlist_takes_networks_and_exact_host_names(monkeypatch, settings):
    settings.NODEPOOL_EGRESS_ALLOW = ["10.20.0.0/16", "provider.corp.example"]
    policy = egress.Policy.from_settings()
    assert policy.refusal(egress.ipaddress.ip_address("10.20.3.4"), "anything.example") is None
    assert policy.refusal(egress.ipaddress.ip_address("10.21.3.4"), "anything.example")
    assert policy.refusal(egress.ipaddress.ip_address("192.168.0.9"), "provider.corp.example") is None
    assert policy.refusal(egress.ipaddress.ip_address("192.168.0.9"), "other.corp.example")
    egress.check_url("http://10.20.0.5/scale")
    with pytest.raises(egress.EgressRefused):
        egress.check_url("http://10.21.0.5/scale")


def test_redirects_are_not_followed(settings):
    allow_loopback(settings)
    target = Receiver()
    redirect = Receiver(status=302, headers={"Location": target.url})
    try:
        answer = egress.request("POST", redirect.url, content=b"{}")
        with pytest.raises(egress.EgressError) as error:
            answer.raise_for_status()
    finally:
        redirect.close()
        target.close()
    assert error.value.summary == "HTTP 302 Found (redirects are not followed)"
    assert error.value.status_code == 302
    assert target.requests == []


def test_a_remote_error_is_summarised_by_its_status_never_its_body(settings):
    allow_loopback(settings)
    receiver = Receiver(status=500, body=b"postgres password: hunter2")
    try:
        with pytest.raises(egress.EgressError) as error:
            egress.post_json(receiver.url, b"{}").raise_for_status()
    finally:
        receiver.close()
    assert str(error.value) == error.value.summary == "HTTP 500 Internal Server Error"
    assert "hunter2" not in repr(error.value)


def test_an_oversized_answer_is_cut_off(settings):
    allow_loopback(settings)
    receiver = Receiver(body=b"x" * 200_000)
    try:
        with pytest.raises(egress.EgressError, match="larger than"):
            egress.request("GET", receiver.url)
    finally:
        receiver.close()


def test_a_connection_failure_has_a_fixed_summary(settings):
    allow_loopback(settings)
    receiver = Receiver()
    receiver.close()  # nothing listens on its port any more
    with pytest.raises(egress.EgressError) as error:
        egress.request("POST", receiver.url)
    assert error.value.summary == "connection failed"


def test_proxies_from_the_environment_are_not_used(settings, monkeypatch):
    allow_loopback(settings)
    monkeypatch.setenv("HTTP_PROXY", "http://10.9.9.9:3128")
    monkeypatch.setenv("ALL_PROXY", "http://10.9.9.9:3128")
    receiver = Receiver()
    try:
        assert egress.request("GET", receiver.url, timeout=3).status_code == 200
    finally:
        receiver.close()
