"""heads/adapters.py: each family's head rows, in its own weight layout."""
import pytest
import torch
from transformers.pytorch_utils import Conv1D

from headprune import prune_heads
from headprune.heads.adapters import get_adapter
from tests.helpers import D, FAMILIES, HEADS, HIDDEN, tiny


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_head_rows_partition_every_projection(family):
    """The adapter's head rows cover each Q/K/V/O feature of a layer exactly once (KV rows once per
    KV head, shared by the query heads of a GQA group), in the family's own weight layout."""
    model = tiny(family)
    prune_heads(model, {1: [1]})
    adapter = get_adapter(model)
    for layer in range(3):
        rows = adapter.head_rows(model, layer)
        covered: dict = {}
        for parts in rows.values():
            for r in parts.values():
                covered.setdefault((id(r.module), r.outputs), (r.module, r.outputs, set()))[2].update(r.index)
        for module, outputs, index in covered.values():
            conv = isinstance(module, Conv1D)  # weight (in, out); Linear (out, in)
            width = module.weight.shape[int(conv) if outputs else int(not conv)]
            assert sorted(index) == list(range(width)), (layer, outputs, width)
        group = adapter.group_size(model.config)
        for head, parts in rows.items():
            same_group = [h for h in rows if h // group == head // group]
            assert all(rows[h]["k"] == parts["k"] and rows[h]["v"] == parts["v"] for h in same_group)


def test_gpt2_head_rows_are_its_fused_qkv_slices():
    model = tiny("gpt2")
    attn = model.transformer.h[0].attn
    rows = get_adapter(model).head_rows(model, 0)
    x = torch.randn(1, 2, HIDDEN)
    full = attn.c_attn(x)  # (1, 2, 3E)
    for head in range(HEADS):
        for part, offset in (("q", 0), ("k", HIDDEN), ("v", 2 * HIDDEN)):
            r = rows[head][part]
            assert r.module is attn.c_attn and (r.start, r.stop) == (offset + head * D, offset + (head + 1) * D)
            torch.testing.assert_close(full[..., r.start:r.stop], x @ r.weight().t() + attn.c_attn.bias[r.start:r.stop])
        assert rows[head]["o"].weight().shape == (D, HIDDEN)
