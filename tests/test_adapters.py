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


def test_every_caller_reads_the_query_to_kv_map_from_the_adapter(monkeypatch):
    """`ArchAdapter.kv_head` is the one query-to-KV-head map: with it replaced by a strided one
    (query head h reads KV head h % 2), head rows, KV group lists, group requests, surgery and
    saving all follow it (a caller computing h // group itself would not)."""
    from headprune import heads_of_kv_groups, kv_group_heads
    from headprune.deploy.hf import plain_counts
    from headprune.heads.adapters import ArchAdapter

    monkeypatch.setattr(ArchAdapter, "kv_head", lambda self, config, head: head % self.num_kv_heads(config))
    model = tiny("llama")  # 4 query heads, 2 KV heads
    adapter = get_adapter(model)
    assert adapter.kv_groups(model.config, range(HEADS)) == {0: [0, 2], 1: [1, 3]}
    assert kv_group_heads(model) == [[0, 2], [1, 3]]
    assert heads_of_kv_groups(model, {0: [1]}) == {0: [1, 3]}
    rows = adapter.head_rows(model, 0)
    assert rows[0]["k"] == rows[2]["k"] and rows[0]["k"] != rows[1]["k"]
    # verify=False: the strided map is not what the attention kernel computes (h // groups), so the pruned
    # model cannot equal the masked one; this test follows the plumbing, not the numbers
    prune_heads(model, {layer: [1, 3] for layer in range(3)}, verify=False)  # KV head 1 goes whole
    assert model.model.layers[0].self_attn.k_proj.weight.shape[0] == D  # one KV head left
    assert model.model.layers[0].self_attn.num_key_value_groups == 2
    assert plain_counts(model)[0] == (2, 1)


def test_only_the_adapter_knows_the_conv1d_weight_layout():
    """GPT-2's Conv1D stores its weight (in, out), Linear (out, in): heads/adapters.py holds that
    fact (`feature_dim`, `num_features`, `set_num_features`, `out_in_weight`, `stores_in_out`), so
    no other module of the package names Conv1D (LoRA's `fan_in_fan_out` and target types ask it too)."""
    import ast

    from tests.helpers import REPO

    def uses_conv1d(path) -> bool:  # in code (an import or a name), not in a docstring
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and any(a.name == "Conv1D" for a in node.names):
                return True
            if isinstance(node, (ast.Name, ast.Attribute)) and "Conv1D" in (getattr(node, "id", None),
                                                                              getattr(node, "attr", None)):
                return True
        return False

    allowed = {"heads/adapters.py"}
    package = REPO / "src" / "headprune"
    naming = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                    if str(p.relative_to(package)) not in allowed and uses_conv1d(p))
    assert naming == []


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_weight_layout_helpers_read_both_layouts(family):
    """`num_features` / `out_in_weight` give the same answer for Conv1D (in, out) and Linear (out, in):
    the fused GPT-2 c_attn has 3E output features, and x @ W(out, in).T is the projection."""
    from headprune.heads.adapters import num_features, out_in_weight

    model = tiny(family)
    adapter = get_adapter(model)
    attn = adapter.attention(adapter.blocks(model)[0])
    q, o = attn.get_submodule(adapter.q), attn.get_submodule(adapter.o)
    assert num_features(q, outputs=True) == (3 * HIDDEN if family == "gpt2" else HIDDEN)
    assert num_features(o, outputs=False) == HIDDEN
    x = torch.randn(2, HIDDEN)
    bias = o.bias if o.bias is not None else 0
    torch.testing.assert_close(o(x), x @ out_in_weight(o).T + bias)
