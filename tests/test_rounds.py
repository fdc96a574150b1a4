"""prune_round, the whole round as a plain function: usable without a Trainer, in a hand-written
prune-and-fine-tune loop."""
import torch

from headprune import HeadMask, prune_heads, prune_round
from headprune.scoring.taylor import taylor_importance
from headprune.selection.layer_policies import GlobalPolicy, SensitivityPolicy
from headprune.selection.schedules import Iterative
from headprune.tasks import forward_logits, task_of
from tests.helpers import tiny_batch, tiny_bert


def test_hand_written_prune_and_finetune_loop(tokenizer):
    model = tiny_bert()
    mask = HeadMask.for_model(model)
    loader = [tiny_batch(tokenizer, 6, seed=s) for s in range(2)]
    schedule = Iterative(target_sparsity=0.5, step=0.25)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rounds = []
    for k in range(schedule.num_rounds):
        r = prune_round(model, mask, taylor_importance, GlobalPolicy(), schedule.heads_to_prune(k, mask.alive()),
                        loader, round_no=k + 1, eval_loader=loader)
        rounds.append(r)
        for batch in loader:  # one epoch of fine-tuning with the mask in place
            loss = task_of(model).loss(forward_logits(model.train(), batch), batch).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert [r.n_pruned for r in rounds] == [3, 3] and mask.sparsity() == 0.5
    assert sorted(h for r in rounds for h in r.pruned) == mask.pruned()
    assert rounds[0].scores.shape == (3, 4) and set(rounds[0].val_before_finetune) == {"acc", "loss"}
    record = rounds[1].record()
    assert record["round"] == 2 and record["heads_per_layer"] == mask.heads_per_layer() and "shortfall" not in record
    prune_heads(model, mask.pruned())  # physically, afterwards
    assert sum(len(kept) for kept in model.headprune_layout) == 6


def test_round_places_what_the_policy_allows_and_measures_sensitivity_once(tokenizer):
    model = tiny_bert()
    mask = HeadMask.for_model(model)
    loader = [tiny_batch(tokenizer, 6)]
    policy = SensitivityPolicy(min_heads_per_layer=3, share=0.5)
    r = prune_round(model, mask, taylor_importance, policy, 5, loader)
    assert r.n_requested == 5 and r.n_pruned == 3 and "min_heads_per_layer=3" in r.shortfall
    assert r.sensitivity is not None and len(r.sensitivity) == 3
    again = prune_round(model, mask, taylor_importance, SensitivityPolicy(min_heads_per_layer=2), 1, loader,
                        sensitivity=r.sensitivity)
    assert again.sensitivity is None and again.n_pruned == 1  # the profile passed in is reused, not re-measured


def test_sync_makes_every_rank_take_rank_zeros_heads(tokenizer):
    model = tiny_bert()
    mask = HeadMask.for_model(model)
    r = prune_round(model, mask, taylor_importance, GlobalPolicy(), 1, [tiny_batch(tokenizer)],
                    sync=lambda heads: [[2, 3]])  # what a broadcast from rank 0 would hand back
    assert r.pruned == [[2, 3]] and mask.pruned() == [[2, 3]]


def test_schedule_owns_the_epoch_timeline():
    s = Iterative(target_sparsity=0.5, step=0.25, baseline_epochs=2, epochs_per_round=3)
    assert [s.round_epoch(k) for k in range(3)] == [2, 5, 8]
    alive = torch.ones(3, 4, dtype=torch.bool)
    assert s.heads_to_prune(0, alive) == 3
    alive[0, :3] = False
    assert s.heads_to_prune(1, alive) == 3 and s.heads_to_prune(0, alive) == 0
