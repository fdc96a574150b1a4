"""deploy/gguf_export.py for Qwen3: a uniform layout (the same whole KV groups kept in every layer,
zero queries padded in where a group is partly kept) is written as llama.cpp's own `qwen3`
architecture (per-head q_norm / k_norm tensors, Q/K rows unpermuted: its rotary is transformers'
rotate_half), and llama.cpp's logits equal PyTorch's on F32 weights; an uneven layout is refused
with the reason before anything is written (only `deci` holds per-layer shapes, and it has no
q_norm / k_norm)."""
import copy

import numpy as np
import pytest
import torch
import transformers as tf

from headprune import prune_heads, save_gguf
from headprune.deploy import llamacpp
from headprune.deploy.gguf_export import gguf_refusal
from tests.helpers import bpe_tokenizer

llamacpp.import_llama_cpp()  # the README's test command installs it: missing, it fails here saying how


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


@pytest.fixture(scope="module")
def qwen3(tok):
    """A random Qwen3 (4 layers, 8 query / 4 KV heads of 16, hidden 64) sized to `tok`: weights std
    0.03 (logits up to ~1), norms not all ones (so their tensors matter)."""
    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=len(tok), hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=16, num_hidden_layers=4, intermediate_size=128, max_position_embeddings=4096,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = tf.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.03)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    return model


@pytest.mark.parametrize("layout", [{i: [0, 1, 6, 7] for i in range(4)}, {i: [0, 6, 7] for i in range(4)}],
                         ids=["whole-groups", "padded"])  # heads removed from every layer
def test_uniform_qwen3_runs_in_llamacpp_as_qwen3(layout, qwen3, tok, tmp_path):
    from gguf import GGUFReader

    model = prune_heads(copy.deepcopy(qwen3), layout)
    out = save_gguf(model, tmp_path / "q.gguf", tokenizer=tok, weights="f32")
    whole = len(layout[0]) == 4  # heads 2-5 kept (KV groups 1, 2); padded: 1-5 kept, group 0 partly
    assert out.arch == "qwen3" and out.layout.kv_heads == [2 if whole else 3] * 4
    assert out.layout.heads == [4 if whole else 6] * 4 and out.layout.padded_heads == (0 if whole else 4)
    names = {t.name for t in GGUFReader(str(out.path)).tensors}
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight"} <= names
    ids = list(range(5, 53))
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].double().numpy()
    loaded = llamacpp.load(out.path, n_ctx=256)
    try:
        got = llamacpp.logits(loaded, ids)
    finally:
        loaded.close()
    # llama.cpp's flash attention rounds to F16 inside: ~1e-3 at these logits (Llama's test: the same)
    assert np.abs(got - want).max() <= 2e-3 and np.abs(want).max() > 0.5


def test_uneven_qwen3_is_refused_before_writing(qwen3, tok, tmp_path):
    model = prune_heads(copy.deepcopy(qwen3), {1: [0, 1]})
    assert "deci architecture holds per-layer shapes, and it has no qwen3 q_norm / k_norm" in gguf_refusal(model)
    with pytest.raises(ValueError, match="GGUF export refused: layers keep different heads"):
        save_gguf(model, tmp_path / "q.gguf", tokenizer=tok)
    assert not list(tmp_path.iterdir())
