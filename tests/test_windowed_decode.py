"""Decoding with windowed KV units (heads/windowed_attention.py): with a cache, a windowed layer's
attention runs the family's kernel once over the full units' keys and once over the windowed
units' held slots; each step's logits equal the masked full-sequence forward's, and no kernel
gets a (B, all KV heads, T, D) tensor."""
import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.models.llama import modeling_llama

from headprune.heads.surgery import prune_heads
from headprune.heads.windowed_attention import KernelConfig
from headprune.heads.windows import KVLayout, KVWindows
from tests.helpers import llama  # tiny Llama: 4 query heads of 8, 2 KV groups unless overridden

SINK, WINDOW = 2, 3
MODES = (("full", "full"), ("window", "full"), ("window", "window"))  # layers with none, some, all windowed
MHA_MODES = (("full",) * 4, ("window", "full", "full", "window"), ("window",) * 4)  # 4 KV heads: one per query head


def tokens(batch: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 100, (batch, n), generator=torch.Generator().manual_seed(seed))


def windowed(attn: str, modes=MODES, **overrides):
    model = llama(attn=attn, num_hidden_layers=len(modes), **overrides)
    KVWindows(KVLayout(modes, sink=SINK, window=WINDOW)).attach(model)
    return model


def stepwise(model, prompt, mask=None, steps: int = 6):
    """(per-step last logits with the cache (steps + 1, B, V), the same from masked full forwards
    without a cache, the sequence): a prefill, then one greedy token per step."""
    cache, seq, cached, full = DynamicCache(config=model.config), prompt, [], []
    mask = torch.ones_like(prompt) if mask is None else mask
    with torch.no_grad():
        out = model(prompt, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
        for step in range(steps + 1):
            cached.append(out)
            full.append(model(seq, attention_mask=mask, use_cache=False).logits[:, -1])
            if step == steps:
                break
            nxt = out.argmax(-1, keepdim=True)  # (B, 1)
            seq, mask = torch.cat([seq, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
            out = model(nxt, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
    return torch.stack(cached), torch.stack(full), seq


@pytest.mark.parametrize("kv_heads", [2, 4])  # GQA (2 query heads per KV head) and MHA
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_each_decode_step_equals_the_masked_full_forward(attn, kv_heads):
    """7-token prompt, 6 steps past sink 2 + window 3: every step's logits with the cache equal
    the masked model's on the whole sequence, and differ from the unwindowed model's."""
    model = windowed(attn, MODES if kv_heads == 2 else MHA_MODES, num_key_value_heads=kv_heads)
    cached, full, seq = stepwise(model, tokens(2, 7))
    assert torch.allclose(cached, full, atol=1e-5)
    with torch.no_grad():
        dense = llama(attn=attn, num_hidden_layers=3, num_key_value_heads=kv_heads)(seq).logits[:, -1]
    assert not torch.allclose(full[-1], dense, atol=1e-3)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_left_padded_batch_decodes_as_the_masked_forward(attn):
    """Row 0 left-padded by 3: the model's padding mask, read at the windowed heads' held slots,
    gives every step the masked full-sequence logits (row 0's sinks are its first real tokens;
    tests/test_windowed_padding.py compares such rows with their prompts alone)."""
    model = windowed(attn)
    prompt, mask = tokens(2, 8), torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    cached, full, _ = stepwise(model, prompt, mask)
    assert torch.allclose(cached, full, atol=1e-5)


def test_a_partly_kept_group_decodes_as_the_masked_forward():
    """Layer 1 keeps one query head of group 0 (the kernel pads it to two slots) and group 1
    whole; group 0 windowed: the split call's halves still pair query heads with their KV heads."""
    model = llama(attn="sdpa", num_hidden_layers=3)
    prune_heads(model, {1: [0]})
    KVWindows(KVLayout(MODES, sink=SINK, window=WINDOW)).attach(model)
    cached, full, _ = stepwise(model, tokens(2, 7))
    assert torch.allclose(cached, full, atol=1e-5)


def kernel_calls(monkeypatch, attn: str) -> list:
    """Records (layer, KV heads, keys) of every attention kernel call: sdpa's torch function, or
    the family's eager function."""
    calls = []
    if attn == "sdpa":
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy(query, key, value, *args, **kwargs):
            calls.append((key.shape[1], key.shape[2]))
            return sdpa(query, key, value, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    else:
        eager = modeling_llama.eager_attention_forward

        def spy(module, query, key, *args, **kwargs):
            calls.append((key.shape[1], key.shape[2]))
            return eager(module, query, key, *args, **kwargs)

        monkeypatch.setattr(modeling_llama, "eager_attention_forward", spy)
    return calls


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_kernel_gets_full_heads_over_all_keys_and_windowed_heads_over_their_slots(attn, monkeypatch):
    """At a decode step with 12 tokens in the cache (sink 2 + window 3): the all-full layer's
    kernel reads both KV heads over 12 keys; the mixed layer's two calls read its full head over
    12 keys and its windowed head over the sink + window = 5 keys the new query sees; the
    all-windowed layer's one call reads both heads over 5. No call reads a windowed layer's KV
    heads all over 12."""
    model = windowed(attn)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(tokens(1, 11), cache=cache, use_cache=True)
        calls = kernel_calls(monkeypatch, attn)
        model(tokens(1, 1), cache=cache, use_cache=True)
    assert calls == [(2, 12), (1, 12), (1, SINK + WINDOW), (2, SINK + WINDOW)]
    assert cache.layers[2].held_tokens() == (0, SINK + WINDOW)


def test_attention_weights_with_the_cache_equal_the_masked_forwards():
    """Eager, output_attentions at a decode step: the split call's weights, put back as (B, H, Q,
    T) with zeros where a windowed head holds no key, equal the masked full forward's last row."""
    model = windowed("eager")
    seq, cache = tokens(2, 10), DynamicCache(config=model.config)
    with torch.no_grad():
        model(seq[:, :-1], cache=cache, use_cache=True)
        step = model(seq[:, -1:], cache=cache, use_cache=True, output_attentions=True).attentions
        full = model(seq, use_cache=False, output_attentions=True).attentions
    for layer in range(3):
        assert step[layer].shape == (2, 4, 1, 10)
        assert torch.allclose(step[layer], full[layer][:, :, -1:], atol=1e-6)


def test_the_module_config_is_the_models_after_every_forward(monkeypatch):
    """The armed forward's KernelConfig is put back after the forward, also when it raises."""
    model = windowed("sdpa")
    attention = model.model.layers[1].self_attn
    with torch.no_grad():
        model.generate(tokens(1, 4), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert attention.config is model.config and attention.headprune_split is None

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", broken)
    with pytest.raises(RuntimeError, match="kernel failed"), torch.no_grad():
        model(tokens(1, 4), cache=DynamicCache(config=model.config), use_cache=True)
    assert attention.config is model.config and not isinstance(attention.config, KernelConfig)
    assert attention.headprune_split is None


def test_a_windowed_cache_without_its_windows_is_refused():
    """Detaching the windows leaves a cache whose windowed layers hold only the full heads'
    keys for the kernel: writing to it is refused instead of attending to the wrong heads."""
    model = llama(attn="sdpa", num_hidden_layers=3)
    windows = KVWindows(KVLayout(MODES, sink=SINK, window=WINDOW)).attach(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(tokens(1, 6), cache=cache, use_cache=True)
        windows.detach()
        with pytest.raises(ValueError, match="outside a forward its KVWindows hook armed"):
            model(tokens(1, 1), cache=cache, use_cache=True)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_chunks_after_single_steps_equal_the_masked_forward(attn):
    """Prefill 7, two one-token steps (the windows' ring turned part way), a 3-token chunk (held
    keys put back in slot order), two more steps: each forward's logits equal the masked full
    forward's at the same positions."""
    model = windowed(attn)
    seq, cache = tokens(2, 14), DynamicCache(config=model.config)
    with torch.no_grad():
        masked = model(seq, use_cache=False).logits
        at = 0
        for size in (7, 1, 1, 3, 1, 1):
            out = model(seq[:, at:at + size], cache=cache, use_cache=True).logits
            assert torch.allclose(out, masked[:, at:at + size], atol=1e-5), (at, size)
            at += size
    assert cache.layers[2].window_slots.tolist() == [[0, 1, 11, 12, 13]] * 2  # per row


def test_a_family_that_does_not_look_its_kernel_up_is_refused(monkeypatch):
    """A forward that runs its own kernel instead of the one `config._attn_implementation` names
    would attend every query head to the full units' keys alone: refused after the forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Fixed:
        def get_interface(self, name, default):
            return sdpa_attention_forward

    model = windowed("sdpa")
    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", Fixed())
    with pytest.raises(ValueError, match="without the split call of windowed KV units"), torch.no_grad():
        model(tokens(1, 4), cache=DynamicCache(config=model.config), use_cache=True)
    assert model.model.layers[1].self_attn.config is model.config


def test_gradients_through_the_split_call_equal_the_masked_forwards():
    """A forward with labels makes a cache unless told not to (use_cache defaults to True), so
    scoring and training with windows attached may run the split call: its loss and gradients
    equal the per-head-masked forward's (use_cache=False)."""
    model = windowed("sdpa", (("window", "full"), ("window", "window"), ("full", "window")))
    batch = tokens(2, 9)
    grads = []
    for use_cache in (True, False):
        model.zero_grad()
        loss = model(batch, labels=batch, use_cache=use_cache).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[0][1], grads[1][1]))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "qwen3", "phi3", "olmo2"])
def test_other_families_decode_as_their_masked_forward(family, attn):
    """The split call goes through each family's own kernel lookup and cache keyword (GPT-NeoX
    passes its cache as `layer_past`): layer 1's first unit and all of layer 2's windowed (sink 1
    + window 2), every step's logits equal the masked full forward's."""
    from tests.helpers import tiny

    model = tiny(family, attn=attn)
    full = KVLayout.uniform(model, "full", sink=1, window=2).modes
    modes = (full[0], ("window",) + full[1][1:], ("window",) * len(full[2]))
    KVWindows(KVLayout(modes, sink=1, window=2)).attach(model)
    cached, masked, _ = stepwise(model, tokens(2, 5, seed=3) % 90, steps=4)
    assert torch.allclose(cached, masked, atol=1e-5)


def test_a_copy_made_after_the_original_ran_still_refuses_the_originals_windows():
    """The hook checks once per module that it is the model's own: a deep copy's modules are
    other modules, so the copy still refuses after the original has run (with and without a
    cache)."""
    import copy

    model = windowed("sdpa")
    with torch.no_grad():
        model(tokens(1, 4), use_cache=False)
        model(tokens(1, 4), cache=DynamicCache(config=model.config), use_cache=True)
        twin = copy.deepcopy(model)
        with pytest.raises(ValueError, match="attached to another model"):
            twin(tokens(1, 4), cache=DynamicCache(config=twin.config), use_cache=True)
