import torch

from headprune.heads.adapters import get_adapter
from headprune.heads.mask import HeadMask
from headprune.tasks import forward_logits, task_of
from headprune.scoring import score_heads
from headprune.scoring.taylor import taylor_importance
from tests.helpers import tiny_batch, tiny_bert


def _direct_taylor(model, batch) -> torch.Tensor:
    """Per example b: |sum_t c_h . dL_b/dc_h| from contexts captured at the output projections,
    one backward pass per example, averaged over examples."""
    adapter = get_adapter(model)
    n_layers, n_heads = len(adapter.blocks(model)), adapter.num_heads(model.config)
    head_dim = adapter.head_dim(model.config)
    total = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    n = batch["input_ids"].shape[0]
    for b in range(n):
        one = {k: v[b:b + 1] for k, v in batch.items()}
        contexts = []
        hooks = [adapter.out_proj(block).register_forward_pre_hook(
            lambda m, args: contexts.append(args[0])) for block in adapter.blocks(model)]
        loss = task_of(model).loss(forward_logits(model, one), one).sum()
        for h in hooks:
            h.remove()
        grads = torch.autograd.grad(loss, contexts)
        for layer, (c, g) in enumerate(zip(contexts, grads)):
            c = c.view(1, -1, n_heads, head_dim)  # (1, T, H, D)
            g = g.view(1, -1, n_heads, head_dim)
            total[layer] += (c * g).sum(dim=(0, 1, 3)).abs().double()
    return (total / n).float()


def test_taylor_matches_direct_per_example_gradient(tokenizer):
    model = tiny_bert("eager")
    batch = tiny_batch(tokenizer, n=6)
    expected = _direct_taylor(model, batch)
    mask = HeadMask.for_model(model)
    got = taylor_importance(model, mask, [batch, ], normalize=False)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
    # Two batches of 3 reduce to the same mean as one batch of 6.
    halves = [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
    torch.testing.assert_close(taylor_importance(model, mask, halves, normalize=False), got, rtol=1e-4, atol=1e-7)


def test_taylor_normalisation_and_pruned_heads(tokenizer):
    model = tiny_bert()
    batch = tiny_batch(tokenizer)
    mask = HeadMask.for_model(model)
    mask.prune([(1, 2)])
    scores = taylor_importance(model, mask, [batch], normalize=True)
    assert scores.shape == (3, 4)
    assert scores[1, 2] == 0
    torch.testing.assert_close(scores.norm(dim=1), torch.ones(3), rtol=1e-5, atol=1e-6)
    assert torch.isfinite(scores).all()


def test_score_heads_entry_point(tokenizer):
    model = tiny_bert()
    batch = tiny_batch(tokenizer)
    scores = score_heads(model, [batch], metric="taylor", normalize=False)
    assert scores.shape == (3, 4) and (scores > 0).all()
    # the temporary mask is removed afterwards: no hooks left on the model
    adapter = get_adapter(model)
    assert all(len(adapter.out_proj(b)._forward_pre_hooks) == 0 for b in adapter.blocks(model))
    try:
        score_heads(model, [batch], metric="nope")
    except ValueError as err:
        assert "metric='nope'" in str(err) and "taylor" in str(err)
    else:
        raise AssertionError("unknown metric accepted")
