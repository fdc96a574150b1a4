"""GGUF exports run in llama.cpp (llama-cpp-python, the `llamacpp` extra the README's test command
installs): logits within 1e-3 of PyTorch's on F32 weights, equal greedy tokens, perplexity within
0.5% of headprune's on the same windows, llama.cpp's per-layer KV bytes equal to the layout's
prediction; a quantized (Q8_0) file runs; the llama.cpp decode bench section on tiny models.
Tiny random models (seconds) and one real pruned SmolLM2 (real_model)."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from headprune import save_gguf
from headprune.deploy import llamacpp
from headprune.evaluation.perplexity import Windows, perplexity
from tests.helpers import UNEVEN, bpe_tokenizer, tiny_llama

llamacpp.import_llama_cpp()  # the README's test command installs it: missing, it fails here saying how, never skips

LAYOUTS = {"uneven": UNEVEN, "uniform": {i: [0, 1, 2, 3] for i in range(4)}, "dense": None}  # uniform: 2 of 4 groups
CTX = 256


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(request, tok, tmp_path_factory):
    """(layout name, PyTorch model, its GGUF export, llama.cpp loaded on it), F32 weights."""
    model = tiny_llama(tok, LAYOUTS[request.param])
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    out = save_gguf(model, path, tokenizer=tok, weights="f32")
    loaded = llamacpp.load(path, n_ctx=CTX)  # llama.cpp's default F16 cache, flash attention
    yield request.param, model, out, loaded
    loaded.close()


def tokens(n: int, seed: int = 0, vocab: int = 261) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_pytorch(served):
    name, model, out, loaded = served
    assert out.arch == ("llama" if name != "uneven" else "deci")
    ids = tokens(48)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].double().numpy()
    got = llamacpp.logits(loaded, ids)
    diff = np.abs(got - want).max()
    assert diff <= 1e-3, f"{name}: max |llama.cpp - PyTorch| = {diff:.2e} (max |logit| {np.abs(want).max():.1f})"
    assert np.abs(want).max() > 0.5  # logits worth comparing


def test_a_headless_layers_fitted_bias_is_served(tok, tmp_path):
    """A layer without heads that keeps a recovery's bias (refit, bias compensation): the export folds
    it into the FFN before it, and llama.cpp's logits still match PyTorch's."""
    model = tiny_llama(tok, {2: list(range(8)), 1: [0, 1, 2, 3]}, attention_bias=True)
    with torch.no_grad():
        model.model.layers[2].self_attn.o_proj.bias.normal_(0, 0.5)
    out = save_gguf(model, tmp_path / "headless.gguf", tokenizer=tok, weights="f32")
    loaded = llamacpp.load(out.path, n_ctx=CTX)
    try:
        ids = tokens(48)
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].double().numpy()
        diff = np.abs(llamacpp.logits(loaded, ids) - want).max()
    finally:
        loaded.close()
    assert out.arch == "deci" and diff <= 1e-3, f"max |llama.cpp - PyTorch| = {diff:.2e}"


def torch_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Plain argmax steps with the KV cache (no generation config: no EOS stop, no logits processors)."""
    out = []
    with torch.no_grad():
        step = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(torch.tensor([[out[-1]]]), past_key_values=step.past_key_values, use_cache=True)
    return out


def test_greedy_tokens_match_pytorch(served):
    name, model, _, loaded = served
    prompt = tokens(8, seed=1)
    assert llamacpp.greedy(loaded, prompt, 32) == torch_greedy(model, prompt, 32)


def test_perplexity_matches_headprune(served):
    name, model, _, loaded = served
    windows = Windows.cut(torch.tensor(tokens(3 * 64, seed=2)), 64)
    ours = perplexity(model, windows)["ppl"]
    theirs = llamacpp.perplexity([llamacpp.logits(loaded, w.tolist()) for w in windows.ids],
                                 [w.tolist() for w in windows.ids])
    assert abs(theirs / ours - 1) <= 0.005, (name, theirs, ours)


def test_kv_bytes_per_layer_as_the_layout_predicts(served):
    name, _, out, loaded = served
    llamacpp.logits(loaded, tokens(20))
    rows = llamacpp.kv_rows(loaded)
    assert rows.cells == 20
    assert rows.per_token == out.layout.kv_bytes_per_token()  # F16 K and V, per layer
    if name == "uneven":
        assert rows.per_token == [128, 0, 32, 64]  # 4, 0, 1, 2 KV heads of 8 values, K + V, 2 bytes
    allocated = llamacpp.kv_allocation(loaded.log)
    assert allocated["layers"] == 4 and allocated["cells"] == CTX
    assert abs(allocated["mib"] - sum(rows.per_token) * CTX / 2**20) <= 0.005 + 1e-9  # logged with 2 decimals


def test_llamacpp_tokenizes_like_the_tokenizer(served, tok):
    _, _, _, loaded = served
    text = "the theme: then the end"
    assert loaded.llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text)


def test_parse_refuses_a_state_it_does_not_understand(served):
    _, _, _, loaded = served
    llamacpp.logits(loaded, tokens(5))
    import ctypes

    import llama_cpp

    ctx = loaded.llm._ctx.ctx
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
    with pytest.raises(ValueError, match="parsed"):
        llamacpp.parse_seq_state(bytes(buf) + b"\0")


@pytest.mark.slow
def test_quantized_file_runs(tmp_path, tok):
    """Q8_0 in a subprocess: a native build's SIGILL on quantized weights fails this test instead of
    killing pytest. Q8_0 logits stay near F32's."""
    model = tiny_llama(tok, UNEVEN)
    q8 = save_gguf(model, tmp_path / "q8.gguf", tokenizer=tok, weights="q8_0")
    assert q8.f16_fallback == ["blk.2.attn_output.weight"]  # the rest is Q8_0
    ids = tokens(24)
    script = (f"import json, numpy as np; from headprune.deploy import llamacpp; "
              f"m = llamacpp.load({str(q8.path)!r}, n_ctx=64); "
              f"print(json.dumps({{'logits': llamacpp.logits(m, {ids}).tolist(), 'system': llamacpp.system_info()}}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"Q8_0 GGUF crashed llama.cpp (rc {done.returncode}: SIGILL is -4): {done.stderr[-500:]}"
    got = np.array(json.loads(done.stdout.strip().splitlines()[-1])["logits"])
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    assert np.isfinite(got).all() and np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.9


# -- the real SmolLM2, pruned unevenly ------------------------------------------------------------------
# max |logit| difference llama.cpp's CPU flash attention (F16 inside) may add: on 4,096 held-out tokens
# 5.5e-2 for the dense SmolLM2 (2.6e-4 without flash attention), experiments/llm_kv/decode/llamacpp/agreement.json
FLASH_ROUNDING = 0.1


@pytest.mark.real_model
def test_pruned_smollm2_in_llamacpp(tmp_path, data_dir):
    """SmolLM2-135M with an uneven layout (one KV group gone from layers 2-29, layers 9 and 20
    attention-free), F32 weights, vocabulary from the package's GGUF. Exact without flash attention
    (F32 cache): logits within 1e-3. As served (flash attention, F16 cache): every argmax and 32
    greedy tokens equal, perplexity within 0.5%, KV bytes per layer as predicted, and the logits
    within FLASH_ROUNDING (llama.cpp's flash attention computes in F16 on CPU)."""
    import copy

    from headprune import heads_of_kv_groups, prune_heads
    from headprune.evaluation.perplexity import text_windows
    from headprune.models.gguf import gguf_source
    from tests.helpers import smollm2

    dense, tokenizer = smollm2()
    model = copy.deepcopy(dense)
    groups = {i: [0] for i in range(2, 30)}
    groups.update({9: [0, 1, 2], 20: [0, 1, 2]})
    prune_heads(model, heads_of_kv_groups(model, groups))
    out = save_gguf(model, tmp_path / "smollm2.gguf", source_gguf=gguf_source("smollm2"), weights="f32")
    assert out.arch == "deci" and out.layout.kv_heads[:3] == [3, 3, 2] and out.layout.kv_heads[9] == 0
    text = (data_dir / "tinyshakespeare" / "input.txt").read_text()[:20000]
    windows = text_windows(tokenizer, text, seq=128, max_tokens=256)
    ids = windows.ids[0].tolist()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].double().numpy()
    exact = llamacpp.load(out.path, n_ctx=256, cache="f32", flash_attn=False)
    try:
        assert np.abs(llamacpp.logits(exact, ids) - want).max() <= 1e-3
    finally:
        exact.close()
    served = llamacpp.load(out.path, n_ctx=256)
    try:
        got = llamacpp.logits(served, ids)
        assert np.abs(got - want).max() <= FLASH_ROUNDING and (got.argmax(1) == want.argmax(1)).mean() >= 0.99
        assert llamacpp.kv_rows(served).per_token == out.layout.kv_bytes_per_token()
        ours = perplexity(model, windows)["ppl"]
        theirs = llamacpp.perplexity([llamacpp.logits(served, w.tolist()) for w in windows.ids],
                                     [w.tolist() for w in windows.ids])
        assert abs(theirs / ours - 1) <= 0.005, (theirs, ours)
        assert llamacpp.greedy(served, ids[:16], 32) == torch_greedy(model, ids[:16], 32)
        sentence = "Shall I compare thee to a summer's day?"
        assert served.llm.tokenize(sentence.encode(), add_bos=False, special=False) == tokenizer.encode(
            sentence, add_special_tokens=False)
    finally:
        served.close()


# -- headprune-bench's llama.cpp section ------------------------------------------------------------------
ONLY_LLAMACPP = ["bench.encoder.enabled=false", "bench.train_step.enabled=false", "bench.onnxruntime.enabled=false",
                 "bench.decoder.enabled=false", "bench.llamacpp.enabled=true"]


@pytest.fixture(scope="module")
def exports(tok, tmp_path_factory):
    """A dense folder (with its tokenizer) and two exports recording it: uniform, and uneven."""
    from headprune import save_pruned

    root = tmp_path_factory.mktemp("bench")
    tiny_llama(tok).save_pretrained(root / "dense")
    tok.save_pretrained(root / "dense")
    for name, layout in (("uniform", LAYOUTS["uniform"]), ("uneven", UNEVEN)):
        save_pruned(tiny_llama(tok, layout), root / name / "export", tokenizer=tok, origin=str(root / "dense"))
    return root


@pytest.mark.slow
def test_bench_section_rows_bounds_and_exact_kv(exports, tmp_path):
    from headprune.apps.bench import run
    from tests.helpers import compose_bench

    dirs = f"[{exports / 'uniform' / 'export'},{exports / 'uneven' / 'export'}]"
    results = run(compose_bench(tmp_path, *ONLY_LLAMACPP, f"bench.llamacpp.pruned_dirs={dirs}",
                                "bench.llamacpp.contexts=[16,32]"))
    rows = results["llamacpp"]
    assert [(r["variant"], r["context"]) for r in rows] == [
        (v, c) for c in (16, 32) for v in ("dense", "uniform", "uneven", "attention_probe")]
    assert {r["arch"] for r in rows} == {"llama", "deci"} and all(r["kv_exact"] for r in rows)
    uneven = next(r for r in rows if r["variant"] == "uneven" and r["context"] == 32)
    assert uneven["kv_layer_bytes_per_token"] == [128, 0, 32, 64]
    assert uneven["kv_ratio"] == pytest.approx(7 / 16) and uneven["kv_heads_share"] == pytest.approx(7 / 16)
    for r in rows:
        assert r["bound"] == pytest.approx(1 / (1 - r["dense_attention_share"] * (1 - r["kept_attention_work"])))
        assert r["tokens_per_s"] == pytest.approx(1000 / r["per_token_ms"]) and r["per_token_ms"] > 0
    assert results["summary"]["llamacpp"]["kv_exact"] is True
    assert "uneven/threads1" in results["summary"]["llamacpp"]
    assert "## llama.cpp decode" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "llamacpp" / "uneven.gguf").is_file()


@pytest.mark.parametrize("override, pattern", [
    ("bench.llamacpp.contexts=[0]", r"bench\.llamacpp\.contexts=\[0\].*allowed: a non-empty list"),
    ("bench.llamacpp.new_tokens=0", r"bench\.llamacpp\.new_tokens=0.*allowed: an integer >= 1"),
    ("bench.llamacpp.weights=q4_0", r"bench\.llamacpp\.weights='q4_0'.*allowed: f32, f16, q8_0"),
])
def test_bench_section_names_a_bad_value(exports, override, pattern, tmp_path):
    from headprune.apps.bench import run
    from tests.helpers import compose_bench

    with pytest.raises(ValueError, match=pattern):
        run(compose_bench(tmp_path, *ONLY_LLAMACPP, f"bench.llamacpp.pruned_dirs=[{exports / 'uneven' / 'export'}]",
                          override))
    assert not (tmp_path / "llamacpp").exists()
