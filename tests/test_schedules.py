"""selection/schedules.py: each schedule's sparsities and epochs, bad values named, and property
tests (hypothesis): schedules are monotone and end at the target."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headprune.selection.schedules import Cubic, Iterative, OneShot, UntilThreshold


@settings(max_examples=200, deadline=None)
@given(target=st.floats(0.0, 0.99), step=st.floats(0.01, 0.99), rounds=st.integers(1, 12),
       initial=st.floats(0.0, 0.99))
def test_schedules_monotone_and_end_at_target(target, step, rounds, initial):
    initial = min(initial, target)
    for schedule in (Iterative(target_sparsity=target, step=step), OneShot(target_sparsity=target),
                     Cubic(target_sparsity=target, rounds=rounds, initial_sparsity=initial),
                     UntilThreshold(target_sparsity=target, step=step)):
        s = schedule.sparsities()
        if target == 0:
            assert s == []
            continue
        assert s[-1] == pytest.approx(target)
        assert all(b >= a - 1e-12 for a, b in zip(s, s[1:]))
        assert all(0 < x <= target + 1e-12 for x in s)
        counts = [schedule.heads_after(i, 144) for i in range(len(s))]
        assert counts == sorted(counts)


def test_a_subnormal_target_gives_no_empty_rounds():
    s = Cubic(target_sparsity=5e-324, rounds=12).sparsities()
    assert s and all(0 < x <= 5e-324 for x in s) and s[-1] == 5e-324


def test_cubic_shape():
    s = Cubic(target_sparsity=0.8, rounds=4).sparsities()
    assert s == pytest.approx([0.8 - 0.8 * (3 / 4) ** 3, 0.8 - 0.8 * (1 / 2) ** 3, 0.8 - 0.8 * (1 / 4) ** 3, 0.8])
    steps = [b - a for a, b in zip([0.0] + s, s)]
    assert steps == sorted(steps, reverse=True)  # fast first, slow near the target


def test_until_threshold_rule():
    s = UntilThreshold(threshold=0.98)
    assert s.stop_reason({"acc": 0.9}, {"acc": 0.89}) is None
    assert s.stop_reason({"acc": 0.9}, {"acc": 0.87}).startswith("threshold")
    with pytest.raises(ValueError, match=r"schedule\.threshold"):
        UntilThreshold(threshold=0)


def test_iterative_sparsities_and_epochs():
    s = Iterative(target_sparsity=0.5, step=0.1, baseline_epochs=2, epochs_per_round=1)
    assert s.sparsities() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    assert s.total_epochs() == 7
    assert [s.heads_after(i, 72) for i in range(5)] == [7, 14, 22, 29, 36]
    assert Iterative(target_sparsity=0.25, step=0.1).sparsities() == pytest.approx([0.1, 0.2, 0.25])
    assert Iterative(target_sparsity=0.0).sparsities() == []


def test_one_shot():
    s = OneShot(target_sparsity=0.7, baseline_epochs=0, epochs_per_round=0)
    assert s.sparsities() == [0.7] and s.total_epochs() == 0


@pytest.mark.parametrize("bad", [1.0, 1.2, -0.1])
def test_target_sparsity_outside_range_names_field(bad):
    with pytest.raises(ValueError, match=r"schedule\.target_sparsity=.*\[0, 1\)"):
        Iterative(target_sparsity=bad)


def test_bad_step_and_epochs_name_field():
    with pytest.raises(ValueError, match=r"schedule\.step=0"):
        Iterative(step=0)
    with pytest.raises(ValueError, match=r"schedule\.epochs_per_round=-1"):
        OneShot(epochs_per_round=-1)


def test_one_rule_for_the_last_head():
    from headprune.selection.schedules import OneShot

    OneShot(target_sparsity=0.99).check_model(total_heads=144)  # round(142.56) = 143: one head left
    with pytest.raises(ValueError, match=r"removes all 12 heads of this model.*at most 0\.9167"):
        OneShot(target_sparsity=0.99).check_model(total_heads=12)
    with pytest.raises(ValueError, match=r"at least one head must remain"):
        OneShot(target_sparsity=1.0)
