"""engine/step_fit.py: a recovery's step budget as a Lightning fit. Its report says what the steps
did; its data order is a function of the step (ranks and accumulation see the same micro-batches);
a fit stopped after a checkpoint and resumed ends with the weights of the uninterrupted fit."""
import pytest
import torch
from torch import nn

from headprune.engine.runtime import Runtime
from headprune.engine.step_fit import WINDOW, FitPlan, StepBatches, checkpoint_step, fit_steps


def _quadratic(steps: int) -> tuple[dict, list[float]]:
    """`steps` steps on a one-parameter quadratic whose loss falls every step; (report, each step's loss)."""
    torch.manual_seed(0)
    model = nn.Linear(1, 1, bias=False)
    nn.init.constant_(model.weight, 3.0)
    seen = []

    def loss_fn(m, batch):
        loss = (m(batch["x"]) - 0.0).pow(2).mean()
        seen.append(loss.item())
        return loss

    loader = [{"x": torch.ones(2, 1), "input_ids": torch.ones(2, 1, dtype=torch.long)}]
    return fit_steps(model, loader, loss_fn, steps, lr=0.3), seen


def test_a_short_run_reports_its_first_and_last_losses_apart():
    """With fewer than 2 x WINDOW steps the first and last windows do not overlap, so a loss that
    fell is not reported as "loss x -> x"."""
    for steps in (2, 5, 10):
        report, seen = _quadratic(steps)
        half = steps // 2
        assert report["loss_window"] == half and report["steps"] == steps
        assert report["loss_first"] == pytest.approx(sum(seen[:half]) / half)
        assert report["loss_last"] == pytest.approx(sum(seen[-half:]) / half)
        assert report["loss_last"] < report["loss_first"]
    report, seen = _quadratic(3 * WINDOW)
    assert report["loss_window"] == WINDOW and report["loss_first"] == pytest.approx(sum(seen[:WINDOW]) / WINDOW)
    one, seen = _quadratic(1)
    assert one["loss_first"] == one["loss_last"] == pytest.approx(seen[0]) and one["loss_window"] == 1


def _indices(**kwargs) -> list[list[int]]:
    return list(StepBatches(10, 3, 4, **kwargs))


def test_ranks_and_accumulation_read_the_same_micro_batches():
    """Two ranks at one micro-batch a step read what one process accumulating two reads, and a fit
    resumed at step 2 reads what the uninterrupted fit reads from step 2 on."""
    one = _indices(accumulate=2, seed=5)
    ranks = [_indices(world=2, rank=r, seed=5) for r in (0, 1)]
    assert [b for step in zip(*ranks) for b in step] == one
    assert _indices(accumulate=2, seed=5, start=2) == one[4:]
    assert len(StepBatches(10, 3, 4, accumulate=2, start=2)) == 8  # Lightning counts the whole fit's batches
    flat = [i for batch in one[:4] for i in batch]
    assert sorted(flat[:10]) == list(range(10))  # each pass is a permutation of the examples
    assert _indices(seed=5) != _indices(seed=6)


class _Crash(RuntimeError):
    pass


def _fit(tmp_path, steps: int, crash_at: int | None = None, resume=None, accumulate: int = 1):
    """A tiny regression net fitted `steps` steps on 12 examples of batch 4 (checkpoint every 2
    steps); `crash_at`: raise in the loss at that micro-batch call; returns (model, report)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(3, generator=g), "y": torch.randn(1, generator=g)} for _ in range(12)]
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    calls = []

    def loss_fn(m, batch):
        calls.append(1)
        if crash_at is not None and len(calls) == crash_at:
            raise _Crash
        return (m(batch["x"]) - batch["y"]).pow(2).mean()

    runtime = Runtime.of({"accelerator": "cpu", "enable_progress_bar": False, "accumulate_grad_batches": accumulate})
    plan = FitPlan(runtime=runtime, checkpoint_dir=tmp_path, checkpoint_every=2, resume_from=resume, seed=3)
    return model, fit_steps(model, loader, loss_fn, steps, lr=0.05, plan=plan)


def test_a_fit_stopped_between_checkpoints_resumes_to_the_same_weights(tmp_path):
    """Stopped at step 4 (after the checkpoint of step 2, with dropout drawing random numbers),
    resumed from it: the weights, the losses and the tokens equal the uninterrupted fit's, bit for bit."""
    whole, report = _fit(tmp_path / "whole", 7)
    with pytest.raises(_Crash):
        _fit(tmp_path / "broken", 7, crash_at=4)
    assert checkpoint_step(tmp_path / "broken" / "last.ckpt") == 2
    resumed, again = _fit(tmp_path / "broken", 7, resume=tmp_path / "broken" / "last.ckpt")
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    assert again["resumed_at_step"] == 2 and report["resumed_at_step"] is None
    assert {k: again[k] for k in ("loss_first", "loss_last", "tokens")} == \
        {k: report[k] for k in ("loss_first", "loss_last", "tokens")}
    assert checkpoint_step(tmp_path / "whole" / "last.ckpt") == 7  # and after the last step


def test_accumulation_takes_one_step_per_accumulated_batches(tmp_path):
    _, report = _fit(tmp_path, 3, accumulate=2)
    assert report["steps"] == 3 and report["accumulate_grad_batches"] == 2
    assert report["tokens"] == 3 * 2 * 4  # steps x micro-batches x examples (no input ids here)


def test_a_non_finite_loss_stops_the_fit_naming_the_step(tmp_path):
    model = nn.Linear(1, 1)
    loader = [{"x": torch.ones(2, 1), "input_ids": torch.ones(2, 1, dtype=torch.long)}]
    with pytest.raises(FloatingPointError, match=r"the training loss is nan at step 1 of 3"):
        fit_steps(model, loader, lambda m, b: m(b["x"]).sum() * float("nan"), 3, lr=0.1)


def test_the_trainers_teardown_leaves_the_model_where_it_trained(monkeypatch):
    """Lightning's teardown moves the LightningModule to the CPU after a fit; the trained model is
    the run's and must stay on its device (on a GPU the evaluation after a recovery read it under
    a mask on the GPU). Seen on CPU as: no tensor of the model is moved during the teardown."""
    from lightning.pytorch.strategies.strategy import Strategy

    moved, tearing = [], [False]
    original_teardown, original_apply = Strategy.teardown, nn.Linear._apply

    def teardown(self):
        tearing[0] = True
        try:
            original_teardown(self)
        finally:
            tearing[0] = False

    def apply(self, fn, *args, **kwargs):
        if tearing[0]:
            moved.append(type(self).__name__)
        return original_apply(self, fn, *args, **kwargs)

    monkeypatch.setattr(Strategy, "teardown", teardown)
    monkeypatch.setattr(nn.Linear, "_apply", apply)
    report, _ = _quadratic(3)
    assert report["steps"] == 3 and moved == []
