"""The XID catalogue (issue 27, item 5): XIDs classified by NVIDIA's resolution buckets."""

from __future__ import annotations

import pytest

from fleet.xid import Resolution, catalogue, classify_xid, worst, xid_154_resolution


@pytest.mark.parametrize("xid", [79, 95, 48, 74])
def test_uncontained_errors_and_a_gpu_off_the_bus_are_fatal_and_evict(xid):
    found = classify_xid(xid)
    assert found.resolution is Resolution.FATAL
    assert found.taint_effect == "NoExecute"
    assert found.evicts and found.known


@pytest.mark.parametrize("xid", [46, 62, 64, 109, 119, 120, 140, 143, 155, 156, 158])
def test_errors_whose_catalogue_action_is_reset_gpu_taint_no_schedule(xid):
    found = classify_xid(xid)
    assert found.immediate_action == "RESET_GPU"
    assert found.resolution is Resolution.RESET_GPU
    assert found.taint_effect == "NoSchedule"
    assert not found.evicts


@pytest.mark.parametrize("xid", [92, 94, 63, 93, 121, 157])
def test_contained_or_warning_level_xids_are_info_and_taint_nothing(xid):
    found = classify_xid(xid)
    assert found.resolution is Resolution.INFO
    assert found.taint_effect is None


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 11, 25, 69, 80])
def test_application_errors_are_the_workloads(xid):
    found = classify_xid(xid)
    assert found.resolution is Resolution.APPLICATION
    assert found.taint_effect is None


def test_a_copy_engine_exception_restarts_the_app_without_blaming_it():
    # RESTART_APP with CONTACT_SUPPORT as the investigation: contained, not the app's bug.
    assert classify_xid(39).resolution is Resolution.INFO


@pytest.mark.parametrize("xid", [999, 0, -5, 173])
def test_an_unknown_xid_is_reset_gpu_by_default(xid):
    found = classify_xid(xid)
    assert found.resolution is Resolution.RESET_GPU
    assert not found.known


@pytest.mark.parametrize("value", ["79", " 79 "])
def test_a_numeric_string_is_read_as_its_number(value):
    assert classify_xid(value).resolution is Resolution.FATAL


@pytest.mark.parametrize("value", [None, "abc", 1.5j, [79]])
def test_garbage_is_unknown_never_an_exception(value):
    found = classify_xid(value)
    assert found.resolution is Resolution.RESET_GPU and not found.known


@pytest.mark.parametrize("xid", [1, 2, 12, 42, 73, 111])
def test_codes_the_catalogue_marks_unused_need_support(xid):
    found = classify_xid(xid)
    assert found.immediate_action == "CONTACT_SUPPORT"
    assert found.resolution is Resolution.RESET_GPU and found.known


@pytest.mark.parametrize(
    ("label", "resolution"),
    [
        ("None", Resolution.INFO),
        ("Drain P2P", Resolution.RESET_GPU),
        ("Drain and Reset", Resolution.RESET_GPU),
        ("GPU Reset Required", Resolution.RESET_GPU),
        ("Node Reboot Required", Resolution.FATAL),
        ("Something New", Resolution.RESET_GPU),
    ],
)
def test_xid_154_follows_the_recovery_action_the_driver_names(label, resolution):
    message = f"GPU recovery action changed from 0x0 (None) to 0x2 ({label})"
    assert classify_xid(154, message).resolution is resolution
    assert xid_154_resolution(message) is resolution


def test_xid_154_without_a_message_is_reset_gpu():
    assert classify_xid(154).resolution is Resolution.RESET_GPU


def test_the_catalogue_classifies_every_listed_code_into_one_of_four_resolutions():
    table = catalogue()
    assert set(range(1, 173)) <= set(table)
    assert {found.resolution for found in table.values()} == set(Resolution)
    assert all(found.known for found in table.values())


def test_worst_picks_the_most_severe():
    classes = [classify_xid(13), classify_xid(64), classify_xid(92)]
    assert worst(classes).xid == 64
    assert worst([*classes, classify_xid(79)]).xid == 79
    assert worst([]) is None
