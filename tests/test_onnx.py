"""deploy/onnx.py: the ONNX export (through headprune-export) checked with ONNX Runtime."""
import json

import pytest
import torch

from headprune import load_pruned, prune_heads, save_pruned
from headprune.apps.export import main as export_main
from tests.helpers import D, PRUNE, inputs, tiny


@pytest.mark.slow  # 5.5-8 s of CPU each (torch.onnx export)
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_onnx_export_equals_the_pruned_model(family, tmp_path, request):
    """Uneven heads per layer and a layer with every head removed (PRUNE), exported with the
    headprune-export CLI: ONNX Runtime's logits equal PyTorch's within 1e-4 on another shape.
    (Llama: the full graph of the llama_decode export below, the same model; an export is ~10 s.)"""
    if family == "llama":
        folder, code = request.getfixturevalue("llama_decode")
        assert code == 0
        graph = folder / "full.onnx"
    else:
        folder = tmp_path
        save_pruned(prune_heads(tiny(family), PRUNE), folder / "model")
        graph = folder / "model.onnx"
        assert export_main([str(folder / "model"), "--onnx", str(graph)]) == 0
    assert load_pruned(folder / "model").headprune_layout[0] == []
    check = json.loads(graph.with_suffix(".check.json").read_text())
    assert check["max_abs_diff"] < 1e-4 and check["batch"] == 3 and check["seq"] == 11
    from headprune.deploy.onnx import onnx_session

    session = onnx_session(graph)
    batch = inputs(batch=2, tokens=7, seed=4)
    feed = {i.name: batch[i.name].numpy() if i.name in batch else torch.zeros_like(batch["input_ids"]).numpy()
            for i in session.get_inputs()}
    got = torch.from_numpy(session.run(None, feed)[0])
    with torch.no_grad():
        want = load_pruned(folder / "model").eval()(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real] if got.dim() == 3 else got, want[real] if want.dim() == 3 else want,
                               atol=1e-4, rtol=0)


# -- the agreement rule (deploy/onnx.py agreement + judge) ------------------------------------------
def test_agreement_rule_passes_float32_noise_on_large_logits_and_flags_what_matters():
    """Logits of scale ~30 with a 3e-4 difference (what a 30-layer float32 decoder shows) pass by
    default; the same difference with logits of scale ~1, a flipped argmax, and NaN each fail,
    naming the option of the broken bound."""
    from headprune.deploy.onnx import agreement, judge

    g = torch.Generator().manual_seed(0)
    want = torch.randn(20, 50, generator=g) * 10
    want[:, 0] = 30.0 + torch.arange(20)  # a clear argmax per position, max |logit| ~ 49
    noise = (torch.rand(20, 50, generator=g) - 0.5) * 6e-4
    figures = agreement(want + noise, want)
    assert 2e-4 < figures["max_abs_diff"] <= 3e-4 and figures["argmax_agreement"] == 1.0
    assert figures["rel_diff"] == pytest.approx(figures["max_abs_diff"] / figures["logit_scale"])
    assert judge(figures) == []
    assert "exceeds --tolerance 0.0001" in " ".join(judge(figures, tolerance=1e-4))  # the old absolute-only rule
    smollm2 = agreement(want + noise * (1e-3 / 3e-4), want)  # the measured pruned SmolLM2 decode steps: 1e-3
    assert smollm2["max_abs_diff"] > 9e-4 and judge(smollm2) == []
    huge = agreement((want + noise) * 1e3, want * 1e3)  # logits of ~5e4: 1e-4 of them would allow 5
    assert [f.split()[0] for f in judge(huge)] == ["max_abs_diff"]

    small = agreement(want / 30 + noise, want / 30)  # same difference, logits 30x smaller
    assert [f.split()[0] for f in judge(small)] == ["rel_diff"] and "--rel-tolerance" in judge(small)[0]

    near = want.clone()
    near[3, 1] = near[3, 0] - 1e-4  # a near-tie in PyTorch ...
    flipped = near.clone()
    flipped[3, 1] += 2e-4  # ... that the other side's 2e-4 difference flips
    tie = agreement(flipped, near)
    assert tie["argmax_agreement"] == pytest.approx(19 / 20) and tie["min_top2_margin"] == pytest.approx(1e-4, rel=0.1)
    assert [f.split()[0] for f in judge(tie)] == ["argmax_agreement"] and "--min-argmax-agreement" in judge(tie)[0]
    assert judge(tie, min_argmax=0.9) == []

    broken = want.clone()
    broken[0, 0] = float("nan")
    nan = agreement(broken, want)
    assert nan["finite"] is False and nan["max_abs_diff"] is None and "not finite" in judge(nan)[0]
    json.dumps(nan, allow_nan=False)  # strict JSON


# -- the decode graph with past key/values (deploy/onnx_decode.py) ----------------------------------
@pytest.fixture(scope="module")
def llama_decode(tmp_path_factory):
    """A tiny Llama-GQA (4 query heads, 2 KV groups of 2) pruned with PRUNE: layer 0 headless,
    layer 1 keeps both KV heads (an uneven group), layer 2 keeps one; exported by headprune-export
    with both graphs."""
    tmp = tmp_path_factory.mktemp("llama_decode")
    save_pruned(prune_heads(tiny("llama"), PRUNE), tmp / "model")
    code = export_main([str(tmp / "model"), "--onnx", str(tmp / "full.onnx"), "--onnx-decode", str(tmp / "decode.onnx")])
    return tmp, code


@pytest.mark.slow  # the module-scoped llama_decode export takes ~20 s
def test_decode_graph_keeps_the_pruned_kv_heads(llama_decode):
    """The graph's past and present tensors have each layer's kept KV heads ([0, 2, 1] of 2), with
    dynamic batch and past length; the check records the smaller cache."""
    from headprune.deploy.onnx import onnx_session

    tmp, code = llama_decode
    assert code == 0
    check = json.loads((tmp / "decode.check.json").read_text())
    assert check["passed"] and check["failures"] == [] and check["kv_heads"] == [0, 2, 1] == check["torch_kv_heads"]
    assert check["cache_bytes_per_token"] == 2 * 3 * D * 4  # keys + values, 3 KV heads of 8 float32 (dense: 6)
    session = onnx_session(tmp / "decode.onnx")
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert [shapes[f"past_key_values.{i}.key"][1] for i in range(3)] == [0, 2, 1]
    assert [shapes[f"past_key_values.{i}.value"][1] for i in range(3)] == [0, 2, 1]
    assert all(shapes[f"past_key_values.{i}.key"][::2] == ["batch", "past_len"] for i in range(3))  # dynamic axes
    assert [o.name for o in session.get_outputs()][:3] == ["logits", "present.0.key", "present.0.value"]


@pytest.mark.slow  # the module-scoped llama_decode export takes ~20 s
def test_decode_graph_generates_what_pytorch_generates(llama_decode):
    """Prefill (empty past, one left-padded row) and 5 greedy steps through the ONNX decode graph,
    feeding back its own present tensors, give HF generate()'s tokens on the pruned model and its
    logits within 1e-4; the past grows by one token per step."""
    from headprune.deploy.onnx import onnx_session
    from headprune.deploy.onnx_decode import empty_past, past_names, positions

    tmp, _ = llama_decode
    model = load_pruned(tmp / "model").eval()
    session = onnx_session(tmp / "decode.onnx")
    batch = inputs(batch=2, tokens=6, seed=7)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        want = model.generate(**batch, max_new_tokens=5, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
    past = [t.numpy() for t in empty_past(model, 2, 0)]
    tokens, logits = [], []
    for step in range(5):
        feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                "position_ids": positions(mask, ids.shape[1]).numpy(), **dict(zip(past_names(3), past))}
        out = session.run(None, feed)
        past = out[1:]
        assert past[2].shape == (2, 2, mask.shape[1], D)  # layer 1's keys: 2 KV heads, past + new tokens
        logits.append(torch.from_numpy(out[0][:, -1]))
        ids = logits[-1].argmax(-1, keepdim=True)
        tokens.append(ids)
        mask = torch.cat([mask, torch.ones_like(ids)], 1)
    assert torch.equal(torch.cat(tokens, 1), want.sequences[:, -5:])
    torch.testing.assert_close(torch.stack(logits), torch.stack(want.logits), atol=1e-4, rtol=0)


@pytest.mark.slow  # the module-scoped llama_decode export takes ~20 s
def test_decode_check_flags_a_perturbed_weight(llama_decode):
    """The check passes the model the graph was exported from and fails one whose weight moved
    after the export (a real mismatch): every bound and the greedy tokens are named."""
    from headprune.deploy.onnx import check_onnx, judge
    from headprune.deploy.onnx_decode import check_onnx_decode, judge_decode

    tmp, _ = llama_decode
    model = load_pruned(tmp / "model").eval()
    assert judge_decode(check_onnx_decode(model, tmp / "decode.onnx")) == []
    assert judge(check_onnx(model, tmp / "full.onnx")) == []
    with torch.no_grad():
        model.model.layers[2].self_attn.v_proj.weight[0, 0] += 0.5
    failures = judge_decode(check_onnx_decode(model, tmp / "decode.onnx"))
    named = " ".join(failures)
    for bound in ("prefill: max_abs_diff", "prefill: rel_diff", "decode: max_abs_diff", "decode: rel_diff",
                  "--min-argmax-agreement", "greedy tokens differ"):
        assert bound in named, (bound, failures)
    assert [f.split()[0] for f in judge(check_onnx(model, tmp / "full.onnx"))][:2] == ["max_abs_diff", "rel_diff"]


@pytest.mark.parametrize("family, args, named", [
    ("bert", ["--onnx-decode", "d.onnx"], "--onnx-decode: the model (BertForSequenceClassification) is not a causal LM"),
    ("mistral", ["--onnx-decode", "d.onnx"], "--onnx-decode: the model has sliding-window"),
    ("llama", [], "give --onnx PATH"),
    ("llama", ["--onnx", "d.onnx", "--onnx-decode", "d.onnx"], "--onnx and --onnx-decode are the same path"),
    ("llama", ["--onnx-decode", "d.onnx", "--min-argmax-agreement", "1.5"], "--min-argmax-agreement 1.5: allowed"),
    ("llama", ["--onnx-decode", "d.onnx", "--rel-tolerance", "nan"], "--rel-tolerance nan: allowed"),
    ("llama", ["--onnx-decode", "d.onnx", "--decode-steps", "0"], "--decode-steps 0: allowed"),
])
def test_export_cli_refuses_what_the_decode_graph_cannot_do_before_exporting(family, args, named, tmp_path,
                                                                             monkeypatch, capsys):
    import headprune.deploy.onnx
    import headprune.deploy.onnx_decode

    for module, name in ((headprune.deploy.onnx, "export_onnx"), (headprune.deploy.onnx_decode, "export_onnx_decode")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("exported anyway"))
    save_pruned(prune_heads(tiny(family), PRUNE), tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "model"), *args])
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err
    assert not list(tmp_path.glob("*.onnx"))


@pytest.mark.slow  # one decode-graph export per family, ~10 s each
@pytest.mark.parametrize("family, kv_heads", [("gpt2", [0, 3, 2]), ("qwen2", [0, 2, 1])])
def test_decode_graph_of_other_decoders(family, kv_heads, tmp_path):
    """GPT-2 (no GQA, Conv1D projections) and Qwen2 (Q/K/V biases) pruned with PRUNE: the decode
    graph passes the check with each layer's kept KV heads."""
    from headprune.deploy.onnx_decode import check_onnx_decode, export_onnx_decode, judge_decode

    model = prune_heads(tiny(family), PRUNE)
    export_onnx_decode(model, tmp_path / "decode.onnx")
    report = check_onnx_decode(model, tmp_path / "decode.onnx")
    assert judge_decode(report) == [] and report["kv_heads"] == kv_heads


def test_decode_verdict_names_other_tokens_and_other_kv_heads():
    """judge_decode on reports whose logits agree: equal tokens and KV heads pass; a graph whose past
    has other KV heads than the pruned model's cache (e.g. the dense count) or other greedy tokens
    fails, naming both sides."""
    from headprune.deploy.onnx_decode import judge_decode

    same = {"finite": True, "max_abs_diff": 0.0, "logit_scale": 1.0, "rel_diff": 0.0, "argmax_agreement": 1.0,
            "positions": 3, "min_top2_margin": 0.1}
    report = {"prefill": same, "decode": same, "tokens_equal": True, "onnx_tokens": [[5, 6]], "torch_tokens": [[5, 6]],
              "kv_heads": [0, 2, 1], "torch_kv_heads": [0, 2, 1]}
    assert judge_decode(report) == []
    assert judge_decode({**report, "kv_heads": [2, 2, 2]}) == [
        "past KV heads per layer differ: ONNX [2, 2, 2] vs PyTorch [0, 2, 1]"]
    assert judge_decode({**report, "tokens_equal": False, "onnx_tokens": [[5, 7]]}) == [
        "greedy tokens differ: ONNX [[5, 7]] vs PyTorch [[5, 6]]"]
