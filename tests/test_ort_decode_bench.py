"""The ONNX Runtime decode section (bench/ort_decode.py): a windowed export's decode graph against the
dense model's through headprune-bench, the past's bytes as the rings hold them, and its refusals."""
import pytest
import torch
from omegaconf import OmegaConf

from headprune.bench.ort_decode import check, decode, prefill, summary, summary_lines
from headprune.heads.windows import KVLayout, apply_kv_layout
from tests.helpers import compose_bench, llama

LAYOUT = KVLayout((("window", "full"), ("removed", "window")), sink=2, window=3)
OFF = [f"bench.{n}.enabled=false" for n in ("encoder", "train_step", "onnxruntime", "decoder")]


def saved(tmp_path):
    from headprune.deploy.hf import save_pruned

    dense = llama(attn="sdpa")
    dense.save_pretrained(tmp_path / "dense")
    model = llama(attn="sdpa")
    apply_kv_layout(model, LAYOUT)
    save_pruned(model, tmp_path / "win" / "export", origin=str(tmp_path / "dense"))
    return tmp_path / "win" / "export"


@pytest.mark.slow  # two decode graphs exported and checked: ~10 s
def test_the_section_times_a_windowed_export_against_dense_through_the_app(tmp_path):
    """headprune-bench with bench.ort_decode on a windowed export: one row per graph and context, the
    past's bytes those of the graph's arrays (full units grow with the context, rings stay at sink +
    window), the graphs kept in `graphs` with passed checks, a prefill in chunks equal to one call, and
    the summary per export. Seen failing with the rings' slot indices left out of `held_bytes` and with
    the prefill's count of tokens seen running past the prompt."""
    from headprune.apps.bench import run
    from headprune.deploy.onnx import onnx_session

    export = saved(tmp_path)
    results = run(compose_bench(tmp_path / "out", *OFF, "bench.ort_decode.enabled=true",
                                f"bench.ort_decode.pruned_dirs=[{export}]", "bench.ort_decode.contexts=[12,20]",
                                f"bench.ort_decode.graphs={tmp_path / 'graphs'}"))
    rows = results["ort_decode"]
    assert [(r["model"], r["context"]) for r in rows] == [("dense", 12), ("win", 12), ("dense", 20), ("win", 20)]
    assert all(r["check"]["tokens_equal"] for r in rows) and all(r["per_token_ms"] > 0 for r in rows)
    # batch 1, 2 KV heads of head_dim 8 (tests.helpers.llama), float32: dense holds K + V of 2 layers x 2 heads
    kv_token = 2 * 8 * 4  # K + V bytes of one unit per token
    for r in rows:
        past = r["context"] - r["new_tokens"]
        if r["model"] == "dense":
            assert r["held_bytes"] == 2 * 2 * past * kv_token and r["held_share"] == 1.0
        else:  # layer 0: one full unit + a ring of 5 slots; layer 1: one ring; each ring's int64 slot indices
            session = onnx_session(r["graph"])
            slots = sum(8 * (LAYOUT.sink + LAYOUT.window) for i in session.get_inputs() if i.name == "past_window_slots")
            assert r["held_bytes"] == past * kv_token + 2 * (LAYOUT.sink + LAYOUT.window) * kv_token + slots
    assert (tmp_path / "graphs" / "win.check.json").is_file() and (tmp_path / "graphs" / "dense.onnx").is_file()
    # the section's prefill (`chunk` tokens a call, the past carried) equals one call over the prompt
    session = onnx_session(tmp_path / "graphs" / "win.onnx")
    prompt = torch.randint(0, 100, (1, 11), generator=torch.Generator().manual_seed(3)).numpy()
    (token, past, seen), (one_token, one_past, one_seen) = prefill(session, prompt, 4), prefill(session, prompt, 11)
    assert seen == one_seen == 11 and (token == one_token).all()
    assert all(a.shape == b.shape and (a.size == 0 or abs(a - b).max() < 1e-4) for a, b in zip(past, one_past))
    decode(session, token, past, seen, 3)
    block = results["summary"]["ort_decode"]
    assert set(block) == {"win/context20"} and block["win/context20"]["held_share"] == rows[3]["held_share"]
    assert "ONNX Runtime decode (3 new tokens" in (tmp_path / "out" / "bench.md").read_text()


def checked(**overrides):
    settings = OmegaConf.create({"enabled": False, "pruned_dirs": [], "contexts": [16], "new_tokens": 3, "chunk": 8,
                                 "graphs": None, **overrides})
    check(settings, OmegaConf.create({"ort_decode": settings, "llm": {"pruned_dirs": []}, "pruned_dir": None,
                                      "dense_model": None}))


def test_bad_settings_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"bench.ort_decode.contexts=\[\] is not allowed"):
        checked(contexts=[])
    with pytest.raises(ValueError, match=r"bench.ort_decode.chunk=0 is not allowed"):
        checked(chunk=0)
    with pytest.raises(ValueError, match=r"each must exceed bench.ort_decode.new_tokens=16"):
        checked(new_tokens=16)
    with pytest.raises(ValueError, match="needs pruned exports"):
        checked(enabled=True)
    with pytest.raises(FileNotFoundError, match=r"bench.ort_decode.pruned_dirs=.*does not exist"):
        checked(enabled=True, pruned_dirs=[str(tmp_path / "nothing")])
    export = saved(tmp_path)
    with pytest.raises(ValueError, match=r"contexts=\[65\] exceeds the model.s 64 positions"):
        checked(enabled=True, pruned_dirs=[str(export)], contexts=[65])
    with pytest.raises(ValueError, match=r"give the row names \['dense', 'win', 'win'\]; allowed: folders with distinct"):
        checked(enabled=True, pruned_dirs=[str(export), str(export)])
    checked(enabled=True, pruned_dirs=[str(export)])


def test_summary_reads_the_longest_context():
    rows = [{"model": m, "context": c, "speedup": s, "held_share": h} for m, c, s, h in
            (("dense", 8, 1.0, 1.0), ("kv", 8, 0.9, 0.6), ("dense", 16, 1.0, 1.0), ("kv", 16, 1.2, 0.4))]
    block = summary(rows, {})
    assert block == {"kv/context16": {"speedup": 1.2, "held_share": 0.4}}
    assert summary_lines(block) == ["- ONNX Runtime decode kv/context16: per token 1.20x dense, past 0.4000 of "
                                    "dense's bytes"]
