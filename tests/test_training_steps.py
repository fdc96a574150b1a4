"""recovery/training_steps.py: the step-budget loop's report says what the steps did."""
import torch
from torch import nn

from headprune.recovery.training_steps import WINDOW, train_steps


def _fit(steps: int) -> tuple[dict, list[float]]:
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
    return train_steps(model, loader, loss_fn, steps, lr=0.3), seen


def test_a_short_run_reports_its_first_and_last_losses_apart():
    """With fewer than 2 x WINDOW steps the first and last windows do not overlap, so a loss that
    fell is not reported as "loss x -> x" (it was when both averaged the same <= 10 steps)."""
    for steps in (2, 5, 10):
        report, seen = _fit(steps)
        half = steps // 2
        assert report["loss_window"] == half
        assert report["loss_first"] == sum(seen[:half]) / half
        assert report["loss_last"] == sum(seen[-half:]) / half
        assert report["loss_last"] < report["loss_first"]
    report, seen = _fit(3 * WINDOW)
    assert report["loss_window"] == WINDOW
    assert report["loss_first"] == sum(seen[:WINDOW]) / WINDOW
    one, seen = _fit(1)
    assert one["loss_first"] == one["loss_last"] == seen[0] and one["loss_window"] == 1
