"""The warning a GPU budget gives when the process already holds more than it."""
from memdoctor.capture.budget import held_past_budget_note

MIB = 1 << 20


def test_a_process_holding_more_than_the_budget_is_told_with_its_bytes():
    note = held_past_budget_note(reserved=2048 * MIB, allocated=1024 * MIB, limit=512 * MIB)
    assert "reserves 2.00 GiB" in note and "1.00 GiB of it in live tensors" in note
    assert "more than the budget of 512.00 MiB" in note and "fresh process" in note


def test_a_process_within_the_budget_hears_nothing():
    assert held_past_budget_note(reserved=512 * MIB, allocated=100 * MIB, limit=512 * MIB) == ""
