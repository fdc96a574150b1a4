"""Left padding with windowed KV units (heads/windows.py, heads/windowed_attention.py): a windowed
unit's sinks and window are counted from each row's first real token, so a left-padded row of a
batch computes what the same prompt computes alone: its logits with and without a cache, its
greedy tokens (generate) and its beam search sequences, under eager and sdpa attention."""
import pytest
import torch
from transformers.cache_utils import DynamicCache

from headprune.heads.windowed_attention import per_head_masks
from headprune.heads.windows import KVLayout, KVWindows
from tests.helpers import llama  # tiny Llama: 4 query heads of 8, 2 KV groups

SINK, WINDOW = 2, 3
MODES = (("full", "full"), ("window", "full"), ("window", "window"))  # layers with none, some, all windowed
PAD = 0


def windowed(attn: str, **overrides):
    model = llama(attn=attn, num_hidden_layers=3, pad_token_id=PAD, **overrides)
    KVWindows(KVLayout(MODES, sink=SINK, window=WINDOW)).attach(model)
    return model


def prompts(lengths, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (n,), generator=g) for n in lengths]


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T), attention mask (B, T)): the rows left-padded with PAD to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """generate()'s position ids under left padding: each row counts from its first real token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_left_padded_row_forwards_as_the_prompt_alone(attn):
    """Without a cache (the banded chunks), with the per-head mask (the ONNX forward graph's
    path) and with a cache (the split call): row 0, padded by 4, gets the logits of its 5 tokens
    alone (sink 2 + window 3 < 5, so the sinks matter). Seen failing with the sinks counted from
    slot 0 (pad slots as sinks): differences of ~0.1."""
    model = windowed(attn)
    short, long = prompts([5, 9])
    ids, mask = left_padded([short, long])
    with torch.no_grad():
        alone = model(short[None]).logits[0]  # (5, V)
        plain = model(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
        with per_head_masks(model):
            masked = model(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
        cached = model(ids, attention_mask=mask, position_ids=positions(mask), cache=DynamicCache(config=model.config),
                       use_cache=True).logits
        long_alone = model(long[None]).logits[0]
    for out in (plain, masked, cached):
        torch.testing.assert_close(out[0, 4:], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(out[1], long_alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_left_padded_row_generates_as_the_prompt_alone(attn):
    """generate() greedy over a batch of prompts of 4, 6 and 9 tokens (left-padded by 5, 3, 0), 12
    new tokens (the windows' ring turns several times): each row's tokens and every step's logits
    equal the prompt's alone; the held window slots of a padded row are its own sinks and last
    window. Seen failing with pad slots counted as sinks (tokens differ)."""
    model = windowed(attn)
    rows = prompts([4, 6, 9], seed=2)
    ids, mask = left_padded(rows)
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True,
                    output_logits=True)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, cache=cache, **settings)
        for i, row in enumerate(rows):
            alone = model.generate(row[None], **settings)
            assert torch.equal(batch.sequences[i, ids.shape[1]:], alone.sequences[0, len(row):]), i
            for step, (got, want) in enumerate(zip(batch.logits, alone.logits)):
                torch.testing.assert_close(got[i], want[0], atol=1e-5, rtol=0, msg=lambda m: f"row {i} step {step}: {m}")
    slots = cache.layers[2].window_slots  # (B, sink + window): row 0's first real token is slot 5
    total = ids.shape[1] + 12 - 1  # tokens the cache has seen after the last step
    assert slots[0].tolist() == [5, 6] + list(range(total - WINDOW, total))
    assert slots[2].tolist() == [0, 1] + list(range(total - WINDOW, total))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_beam_search_on_a_left_padded_batch_equals_each_prompt_alone(attn):
    """Beam search (3 beams, 2 sequences returned) expands and reorders the cache's rows with
    their first real tokens: a padded batch returns each prompt's sequences alone."""
    model = windowed(attn)
    rows = prompts([4, 7], seed=3)
    ids, mask = left_padded(rows)
    settings = dict(max_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=2, pad_token_id=PAD)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **settings)
        for i, row in enumerate(rows):
            alone = model.generate(row[None], **settings)
            assert torch.equal(batch[2 * i:2 * i + 2, ids.shape[1]:], alone[:, len(row):]), i


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_long_left_padded_prefill_chunks_as_the_prompt_alone(attn):
    """A 150-token prompt padded by 20 (more queries than a chunk, windowed_attention.MIN_CHUNK),
    with and without a cache: the padded row's logits equal the prompt's alone."""
    model = windowed(attn, max_position_embeddings=256)
    short, long = prompts([150, 170], seed=4)
    ids, mask = left_padded([short, long])
    with torch.no_grad():
        alone = model(short[None]).logits[0]
        plain = model(ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
        cached = model(ids, attention_mask=mask, position_ids=positions(mask), cache=DynamicCache(config=model.config),
                       use_cache=True).logits
    for out in (plain, cached):
        torch.testing.assert_close(out[0, 20:], alone, atol=1e-5, rtol=0)


def test_reordered_rows_keep_their_own_sinks():
    """Reordering the cache's rows (what beam search and batch selection do) moves each row's held
    slots and first real token with its keys: rows of different padding swapped after a prefill
    decode as the unswapped batch's rows. Seen failing with the slots or first tokens left in place."""
    model = windowed("sdpa")
    ids, mask = left_padded(prompts([4, 9], seed=5))
    runs = []
    for order in (torch.tensor([0, 1]), torch.tensor([1, 0])):
        cache, seq_mask = DynamicCache(config=model.config), mask.clone()
        with torch.no_grad():
            out = model(ids, attention_mask=mask, position_ids=positions(mask), cache=cache, use_cache=True).logits[:, -1]
            cache.reorder_cache(order)
            out, seq_mask, steps = out[order], seq_mask[order], []
            for _ in range(6):
                nxt = out.argmax(-1, keepdim=True)  # (B, 1)
                seq_mask = torch.cat([seq_mask, torch.ones_like(nxt)], 1)
                out = model(nxt, attention_mask=seq_mask, position_ids=positions(seq_mask)[:, -1:], cache=cache,
                            use_cache=True).logits[:, -1]
                steps.append(out)
        runs.append((order, torch.stack(steps, 1)))
    (_, straight), (order, swapped) = runs
    torch.testing.assert_close(swapped, straight[order], atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_loaded_export_generates_and_beam_searches_a_left_padded_batch_as_each_prompt_alone(attn, tmp_path):
    """The export as a user gets it (issue 56, item 2): a layout with a removed unit and windowed ones,
    `save_pruned`, then `load_pruned` under `attn`; greedy generate() and beam search over a
    left-padded batch give each row what its prompt gives alone, and the loaded model's tokens equal
    the model that was saved."""
    from headprune.deploy.hf import load_pruned, save_pruned
    from headprune.heads.windows import apply_kv_layout

    model = llama(attn=attn, num_hidden_layers=3, pad_token_id=PAD)
    apply_kv_layout(model, KVLayout((("full", "removed"), ("window", "full"), ("window", "window")), SINK, WINDOW))
    save_pruned(model, tmp_path / "export")
    loaded = load_pruned(tmp_path / "export", attn_implementation=attn).eval()
    rows = prompts([4, 9], seed=6)
    ids, mask = left_padded(rows)
    for settings in (dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD),
                     dict(max_new_tokens=8, do_sample=False, num_beams=3, num_return_sequences=1, pad_token_id=PAD)):
        with torch.no_grad():
            batch = loaded.generate(ids, attention_mask=mask, **settings)
            assert torch.equal(batch, model.generate(ids, attention_mask=mask, **settings))
            for i, row in enumerate(rows):
                alone = loaded.generate(row[None], **settings)
                assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(row):]), (settings, i)
