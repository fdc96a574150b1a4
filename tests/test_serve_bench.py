"""The serving bench (bench/serve.py) and its static cache (deploy/static_cache.py): static and
ring decode equal the dynamic cache's, nothing is allocated per step, the capacity search agrees
with the counted bytes, and the section's rows on tiny models (CPU, eager steps)."""
import copy

import pytest
import torch
from omegaconf import OmegaConf
from transformers.cache_utils import DynamicCache

from headprune.bench.serve import Stepper, capacity, check, prefill, serve_rows, weights_bytes
from headprune.costs.kv_bytes import cache_bytes, model_bytes
from headprune.costs.timing import Clock
from headprune.deploy.static_cache import StaticWindowedLayer, repeat_rows, restore, snapshot, static_cache
from headprune.heads.windows import KVLayout, apply_kv_layout
from tests.helpers import llama
from tests.test_kv_bytes import gemma3

LAYOUT = KVLayout((("window", "full"), ("removed", "window")), sink=2, window=3)


def windowed(attn="sdpa", **overrides):
    model = llama(attn=attn, **overrides)
    apply_kv_layout(model, LAYOUT)
    return model


def dynamic_logits(model, prompt, steps):
    """Last-position logits of the prefill and of `steps` greedy steps with a DynamicCache."""
    cache, outs = DynamicCache(config=model.config), []
    with torch.no_grad():
        out = model(input_ids=prompt, cache=cache, use_cache=True)
        outs.append(out.logits[:, -1])
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
            outs.append(out.logits[:, -1])
    return torch.stack(outs)  # (steps + 1, B, V)


def static_logits(model, prompt, steps, max_len):
    cache, outs = static_cache(model, max_len), []
    t = prompt.shape[1]
    with torch.no_grad():
        out = model(input_ids=prompt, cache=cache, position_ids=torch.arange(t)[None], use_cache=True)
        outs.append(out.logits[:, -1])
        for i in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache, position_ids=torch.tensor([[t + i]]),
                        use_cache=True)
            outs.append(out.logits[:, -1])
    return torch.stack(outs), cache


@pytest.mark.parametrize("make,tokens", [(lambda: windowed("sdpa"), 7), (lambda: windowed("eager"), 7),
                                         (lambda: windowed("sdpa", max_position_embeddings=512), 300),
                                         (lambda: llama(attn="sdpa"), 7),
                                         (lambda: gemma3(num_hidden_layers=3), 9)])
def test_static_and_ring_decode_equal_the_dynamic_cache(make, tokens):
    """Windowed units (eager, sdpa; a 300-token prefill attends chunk by chunk over the ring),
    a dense Llama and Gemma 3's own sliding layers: every step's logits equal the dynamic cache's,
    and the static cache holds its price (costs.kv_bytes, static)."""
    model = make()
    prompt = torch.randint(3, 60, (2, tokens), generator=torch.Generator().manual_seed(0))
    expected = dynamic_logits(model, prompt, 8)
    got, cache = static_logits(model, prompt, 8, tokens + 10)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cache_bytes(cache) == sum(model_bytes(model, tokens + 10, batch=2, static=True))


def test_a_cache_shorter_than_the_window_holds_no_more_than_its_tokens():
    """max_len 8 < sink + window = 20: the ring holds 8 entries, the price says so, decode is exact."""
    model = llama(attn="sdpa")
    apply_kv_layout(model, KVLayout((("window", "full"), ("window", "window")), sink=4, window=16))
    prompt = torch.randint(3, 60, (2, 3), generator=torch.Generator().manual_seed(2))
    got, cache = static_logits(model, prompt, 5, 8)
    torch.testing.assert_close(got, dynamic_logits(model, prompt, 5), atol=1e-5, rtol=1e-5)
    assert cache.layers[0].window_keys.shape[-2] == 8
    assert cache_bytes(cache) == sum(model_bytes(model, 8, batch=2, static=True))


def test_ring_decode_allocates_nothing_per_step():
    """After the prefill, the Stepper's greedy steps write in place: every buffer keeps its
    address and the byte count stays; the tokens are the dynamic cache's greedy tokens."""
    model = windowed()
    prompt = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(1))
    cache = static_cache(model, 20)
    with torch.no_grad():
        token = prefill(model, cache, prompt)
    ring = cache.layers[0]
    assert isinstance(ring, StaticWindowedLayer)
    addresses = [t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)
                 + ((layer.window_keys, layer.window_values, layer.slots) if isinstance(layer, StaticWindowedLayer)
                    else ())]
    held = cache_bytes(cache)
    stepper = Stepper(model, cache, token, 6, "none")
    tokens = []
    with torch.no_grad():
        for _ in range(7):
            stepper.run(1)
            tokens.append(stepper.token.clone())
    assert [t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)
            + ((layer.window_keys, layer.window_values, layer.slots) if isinstance(layer, StaticWindowedLayer)
               else ())] == addresses
    assert cache_bytes(cache) == held
    assert sorted(ring.slots.tolist()) == [0, 1, 10, 11, 12]  # sinks + the last 3 of 13 tokens
    expected = dynamic_logits(model, prompt, 7).argmax(-1)[1:]  # (7, 1)
    assert torch.equal(torch.cat(tokens, dim=1)[0], expected[:, 0])
    assert stepper.graphs == "none"


def test_snapshot_restores_positions_and_rings():
    model = windowed()
    prompt = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(1))
    cache = static_cache(model, 20)
    with torch.no_grad():
        token = prefill(model, cache, prompt)
    saved = snapshot(cache)
    stepper = Stepper(model, cache, token, 6, "none")
    with torch.no_grad():
        stepper.run(5)
        first = stepper.token.clone()
        restore(cache, saved)
        stepper.reset()
        stepper.run(5)
    assert torch.equal(stepper.token, first)


def test_capacity_agrees_with_the_counted_cache():
    """The largest batch whose weights + counted static cache fit the budget is `capacity`'s, for
    a windowed export and the dense model; a budget below the weights fits none."""
    for model in (windowed(), llama(attn="sdpa")):
        prompt = torch.randint(3, 60, (1, 8))
        per_sequence = sum(model_bytes(model, 12, static=True))
        weights = weights_bytes(model)
        budget = weights + 5 * per_sequence + per_sequence // 2
        cap = capacity(weights, per_sequence, budget, limit=100)
        assert cap == 5
        for batch, fits in ((cap, True), (cap + 1, False)):
            cache = static_cache(model, 12)
            with torch.no_grad():
                prefill(model, cache, prompt)
            repeat_rows(cache, batch)
            assert (weights + cache_bytes(cache) <= budget) is fits
        assert capacity(weights, per_sequence, budget, limit=3) == 3
        assert capacity(weights, per_sequence, weights - 1, limit=3) == 0


def test_serve_rows_on_tiny_models():
    """Dense against a windowed copy at context 16: the export fits more sequences, every timed
    row's counted cache equals its price, batches beyond a model's capacity are not timed."""
    dense = llama(attn="sdpa")
    export = copy.deepcopy(dense)
    apply_kv_layout(export, LAYOUT)
    per_dense = sum(model_bytes(dense, 19, static=True))
    budget = weights_bytes(dense) + 3 * per_dense
    rows = serve_rows([("dense", dense), ("windowed", export)], 16, [1, 2], 3, budget, 64, "none", Clock("cpu"),
                      warmup=0, repeats=1)
    by = {(r["model"], r["batch"]): r for r in rows}
    assert by[("dense", 1)]["capacity"] == 3 and by[("windowed", 1)]["capacity"] > 3
    assert sorted({r["batch"] for r in rows}) == [1, 2, 3, by[("windowed", 1)]["capacity"]]
    cap = by[("windowed", 1)]["capacity"]
    assert not by[("dense", cap)]["fits"] and by[("dense", cap)]["tokens_per_s"] is None
    for r in rows:
        if r["fits"]:
            assert r["cache_bytes"] == r["predicted_cache_bytes"] and r["tokens_per_s"] > 0 and r["graphs"] == "none"
    assert by[("windowed", 1)]["capacity_ratio"] == cap / 3


def test_settings_are_checked_before_any_work():
    base = dict(enabled=False, pruned_dirs=[], contexts=[16], batches=[1], new_tokens=3, memory_gib=1.0,
                max_batch=8, graphs="none")

    def checked(**changes):
        settings = {**base, **changes}
        bench = OmegaConf.create({"device": "cpu", "dense_model": None, "pruned_dir": None,
                                  "llm": {"pruned_dirs": []}, "serve": settings})
        check(bench.serve, bench)

    checked()
    with pytest.raises(ValueError, match="graphs: 'graph' is not allowed; allowed: none, cuda_graph, compile"):
        checked(graphs="graph")
    with pytest.raises(ValueError, match="memory_gib=0"):
        checked(memory_gib=0)
    with pytest.raises(ValueError, match="needs pruned exports"):
        checked(enabled=True)
    with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
        checked(enabled=True, graphs="cuda_graph")


@pytest.mark.slow  # the app over two saved models: over ~2 s
def test_the_serve_section_runs_a_windowed_export_through_the_app(tmp_path):
    """headprune-bench with bench.serve on a saved windowed export (its windows attached by
    load_pruned) against the dense folder it records: rows per context x batch, the counted
    cache equal to its price, and the summary's capacity ratio above 1."""
    from headprune.apps.bench import run
    from headprune.deploy.hf import save_pruned
    from tests.helpers import compose_bench

    dense = llama(attn="sdpa")
    dense.save_pretrained(tmp_path / "dense")
    save_pruned(windowed(), tmp_path / "win" / "export", origin=str(tmp_path / "dense"))
    off = [f"bench.{n}.enabled=false" for n in ("encoder", "train_step", "onnxruntime", "decoder")]
    results = run(compose_bench(tmp_path / "out", *off, "bench.serve.enabled=true",
                                f"bench.serve.pruned_dirs=[{tmp_path / 'win' / 'export'}]",
                                "bench.serve.memory_gib=0.000107", "bench.serve.max_batch=16"))
    rows = results["serve"]
    assert {r["model"] for r in rows} == {"dense", "win"} and {r["context"] for r in rows} == {16}
    assert all(r["cache_bytes"] == r["predicted_cache_bytes"] for r in rows if r["fits"])
    block = results["summary"]["serve"]["win/context16"]
    assert block["capacity_ratio"] > 1 and block["graphs"] == ["none"]


def test_summary_reads_capacity_and_throughput_against_dense():
    """Per export and context: capacity against dense's, tokens/s at dense's capacity batch and the
    batch-1 step against dense's, each target reported hit or miss."""
    from headprune.bench.serve import summary, summary_lines

    def row(model, batch, cap, tps, fits=True):
        return {"model": model, "context": 8192, "batch": batch, "capacity": cap, "dense_capacity": 2,
                "capacity_ratio": cap / 2, "ttft_ms": 10.0 if model == "dense" else 8.0, "fits": fits,
                "tokens_per_s": tps, "per_step_ms": batch * 1000 / tps if tps else None,
                "graphs": "none" if fits else None}

    rows = [row("dense", 1, 2, 100.0), row("dense", 2, 2, 150.0), row("dense", 6, 2, None, fits=False),
            row("kv", 1, 6, 90.0), row("kv", 2, 6, 320.0), row("kv", 6, 6, 600.0)]
    block = summary(rows, {})["kv/context8192"]
    assert block["capacity_ratio"] == 3 and block["tokens_per_s_ratio_at_dense_capacity"] == 320 / 150
    assert block["tokens_per_s_ratio_at_capacity"] == 600 / 150 and block["batch1_step_ratio"] == 0.9
    assert block["ttft_ratio"] == 10 / 8 and block["graphs"] == ["none"]
    line, = summary_lines({"kv/context8192": block})
    assert "3.00x; target >= 2.5x: hit" in line and "2.13x dense (target >= 2x: hit)" in line
    assert "batch-1 step 0.90x dense (target no worse: miss)" in line
