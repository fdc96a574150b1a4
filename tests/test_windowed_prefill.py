"""Forwards without a cache through windowed KV units (heads/windowed_attention.py `BandCall`):
the full units' heads attend under the model's own mask, the windowed units' heads chunk by chunk
over only the keys their window lets them see. Outputs and gradients equal attention by hand and
the per-head-masked single call; no kernel call reads a windowed head over every key; a family
that does not look its kernel up keeps the per-head mask. Tiny Llama built from a config."""
import pytest
import torch
from transformers.models.llama import modeling_llama

from headprune.heads import windowed_attention
from headprune.heads.windowed_attention import ROUTES
from headprune.heads.windows import KVLayout, KVWindows
from tests.helpers import llama
from tests.test_kv_modes import by_hand, capture, ids

SINK, WINDOW = 2, 3


@pytest.fixture(autouse=True)
def fresh_routes(monkeypatch):
    """Chunks of max(window, MIN_CHUNK) = 3 queries (several per sequence), and no module class
    known yet to look its kernel up (restored after)."""
    monkeypatch.setattr(windowed_attention, "MIN_CHUNK", 1)
    saved = dict(ROUTES)
    ROUTES.clear()
    yield
    ROUTES.clear()
    ROUTES.update(saved)


def windowed(attn: str, modes, **overrides):
    model = llama(attn=attn, num_hidden_layers=len(modes), **overrides)
    KVWindows(KVLayout(modes, sink=SINK, window=WINDOW)).attach(model)
    return model


def assert_layer_1_by_hand(model, modes) -> None:
    """One forward without a cache: layer 1's attention context equals the loops' (`by_hand`)."""
    seen, handles = capture(model, 1)
    with torch.no_grad():
        model(ids(), use_cache=False)
    for h in handles:
        h.remove()
    assert torch.allclose(seen["context"], by_hand(model, seen, modes[1], SINK, WINDOW), atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_chunked_windowed_heads_equal_attention_by_hand(attn):
    """Layer 1 of 12 tokens (4 chunks of 3): group 0 windowed, group 1 full, as the loops compute
    them, on the first forward (per-head mask also handed) and on the next (the class known)."""
    modes = (("full", "full"), ("window", "full"))
    model = windowed(attn, modes)
    for _ in range(2):
        assert_layer_1_by_hand(model, modes)
    assert ROUTES[modeling_llama.LlamaAttention] is True


def _masked_reference(model, batch, mask=None):
    """Logits, loss and gradients of the per-head-masked single kernel call (the class marked as
    not looking its kernel up), then the class forgotten again."""
    ROUTES[modeling_llama.LlamaAttention] = False
    try:
        return _loss_and_grads(model, batch, mask)
    finally:
        ROUTES.clear()


def _loss_and_grads(model, batch, mask=None):
    model.zero_grad()
    out = model(batch, attention_mask=mask, labels=batch, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_chunked_logits_and_gradients_equal_the_per_head_masked_call(attn, kv_heads):
    """GQA and MHA, layers with some and with all units windowed, 14 tokens: the chunked forward's
    logits and every parameter's gradient equal the single per-head-masked call's."""
    modes = ((("window", "full"), ("window", "window")) if kv_heads == 2 else
             (("window", "full", "full", "window"), ("window",) * 4))
    model = windowed(attn, modes, num_key_value_heads=kv_heads)
    batch = ids(2, 14)
    reference = _masked_reference(model, batch)
    for _ in range(2):  # the first forward, then with the class known to look its kernel up
        logits, grads = _loss_and_grads(model, batch)
        assert torch.allclose(logits, reference[0], atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads, reference[1]))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_left_padded_batch_chunks_as_the_masked_call(attn):
    """Row 0 left-padded by 4 (its sinks are its first real tokens, in both paths)."""
    model = windowed(attn, (("window", "full"), ("window", "window")))
    batch = ids(2, 13)
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    reference = _masked_reference(model, batch, mask)
    logits, grads = _loss_and_grads(model, batch, mask)
    assert torch.allclose(logits[1], reference[0][1], atol=1e-5)
    assert torch.allclose(logits[0, 4:], reference[0][0, 4:], atol=1e-5)


def test_no_kernel_call_reads_a_windowed_head_over_every_key(monkeypatch):
    """sdpa, 24 tokens, chunks of 3: the full group's call reads every key with the model's causal
    shortcut (no mask); each windowed call reads at most sink + window - 1 + chunk = 7 keys under a
    mask of its chunk only; the per-head (B, H, T, T) mask is built on the first forward alone."""
    model = windowed("sdpa", (("window", "full"),))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls, built = [], []

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        calls.append((key.shape[1], key.shape[2], None if attn_mask is None else tuple(attn_mask.shape)))
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    per_head = windowed_attention.per_head_mask
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr("headprune.heads.windows.per_head_mask", lambda *a: built.append(1) or per_head(*a))
    with torch.no_grad():
        model(ids(1, 24), use_cache=False)
        first = len(built)
        calls.clear()
        model(ids(1, 24), use_cache=False)
    assert first == 1 and len(built) == 1
    assert calls[0] == (1, 24, None)
    windowed_calls = calls[1:]
    assert len(windowed_calls) == 8 and all(k <= SINK + WINDOW - 1 + 3 and mask[-2] == 3 and mask[-1] == k
                                           for _, k, mask in windowed_calls)


def test_a_family_that_does_not_look_its_kernel_up_keeps_the_per_head_mask(monkeypatch):
    """Its attention runs a fixed kernel on the attention_mask it is handed: the per-head mask
    then restricts the windows (logits equal attention by hand), the class is recorded as not
    looking its kernel up, and later forwards still get the per-head mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Fixed:
        def get_interface(self, name, default):
            return sdpa_attention_forward

    modes = (("full", "full"), ("window", "full"))
    model = windowed("sdpa", modes)
    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", Fixed())
    for _ in range(2):
        assert_layer_1_by_hand(model, modes)
        assert ROUTES[modeling_llama.LlamaAttention] is False
    assert model.model.layers[1].self_attn.config is model.config
