"""Deploy: ONNX export checked with ONNX Runtime, plain from_pretrained where the shapes allow it."""
import json

import pytest
import torch
import transformers as tf

from headprune import heads_of_kv_groups, load_pruned, prune_heads, save_pruned
from headprune.apps.export import main as export_main
from tests.test_surgery import PRUNE, inputs, tiny


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_onnx_export_equals_the_pruned_model(family, tmp_path):
    """Uneven heads per layer and a layer with every head removed (PRUNE), exported with the
    headprune-export CLI: ONNX Runtime's logits equal PyTorch's within 1e-4 on another shape."""
    model = prune_heads(tiny(family), PRUNE)
    assert model.headprune_layout[0] == []
    save_pruned(model, tmp_path / "model")
    assert export_main([str(tmp_path / "model"), "--onnx", str(tmp_path / "model.onnx")]) == 0
    check = json.loads((tmp_path / "model.check.json").read_text())
    assert check["max_abs_diff"] < 1e-4 and check["batch"] == 3 and check["seq"] == 11
    from headprune.deploy.onnx import onnx_session

    session = onnx_session(tmp_path / "model.onnx")
    batch = inputs(batch=2, tokens=7, seed=4)
    feed = {i.name: batch[i.name].numpy() if i.name in batch else torch.zeros_like(batch["input_ids"]).numpy()
            for i in session.get_inputs()}
    got = torch.from_numpy(session.run(None, feed)[0])
    with torch.no_grad():
        want = load_pruned(tmp_path / "model").eval()(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real] if got.dim() == 3 else got, want[real] if want.dim() == 3 else want,
                               atol=1e-4, rtol=0)


def test_export_cli_names_what_it_cannot_use(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither a run dir \(results\.json\) nor a model folder"):
        export_main([str(tmp_path), "--onnx", str(tmp_path / "x.onnx")])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_uniform_gqa_layouts_load_with_plain_transformers(family, tmp_path):
    """The same KV groups' worth of heads in every layer: save_pruned writes a standard checkpoint
    (config with the new head counts) that AutoModelForCausalLM loads with no headprune code."""
    model = tiny(family)
    prune_heads(model, heads_of_kv_groups(model, {0: [0], 1: [1], 2: [0]}))
    saved = save_pruned(model, tmp_path)
    assert saved.plain_hf and not (tmp_path / "headprune_layout.json").exists()
    assert model.config.num_attention_heads == 4  # the live model's config still describes the original
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (plain.config.num_attention_heads, plain.config.num_key_value_heads) == (2, 1)
    batch = inputs()
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, model(**batch).logits, atol=1e-6, rtol=0)
    provenance = json.loads((tmp_path / "headprune_export.json").read_text())
    assert provenance["kept_heads"] == [[2, 3], [0, 1], [2, 3]]


@pytest.mark.parametrize("family,heads,why", [
    ("llama", PRUNE, "a layer has no heads"),
    ("llama", {0: [0]}, "a KV group partly kept"),
    ("llama", {0: [0, 1]}, "layers keep different numbers of heads"),
    ("bert", {0: [0]}, "config has no head_dim of its own"),
])
def test_other_layouts_say_they_need_load_pruned(family, heads, why, tmp_path):
    saved = save_pruned(prune_heads(tiny(family), heads), tmp_path)
    assert not saved.plain_hf and why in saved.why and (tmp_path / "headprune_layout.json").is_file()


@pytest.mark.parametrize("tolerance", ["-1", "nan", "inf"])
def test_export_cli_refuses_a_bad_tolerance_before_exporting(tolerance, tmp_path, monkeypatch, capsys):
    import headprune.deploy.onnx

    monkeypatch.setattr(headprune.deploy.onnx, "export_onnx", lambda *a, **k: pytest.fail("exported anyway"))
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "model")
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "model"), "--onnx", str(tmp_path / "m.onnx"), "--tolerance", tolerance])
    assert exit_.value.code == 2
    assert "--tolerance" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["parent_is_a_file", "is_a_folder"])
def test_export_cli_refuses_an_unwritable_onnx_path_before_exporting(where, tmp_path, monkeypatch, capsys):
    import headprune.deploy.onnx

    monkeypatch.setattr(headprune.deploy.onnx, "export_onnx", lambda *a, **k: pytest.fail("exported anyway"))
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "model")
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder.onnx").mkdir()
    target = tmp_path / "file" / "m.onnx" if where == "parent_is_a_file" else tmp_path / "folder.onnx"
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "model"), "--onnx", str(target)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--onnx" in err and str(target) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder.onnx", "model"]  # nothing written


def test_export_cli_says_why_it_exits_1(tmp_path, monkeypatch, capsys):
    """A difference over --tolerance: exit 1 with a line on stderr saying so."""
    import headprune.deploy.onnx

    monkeypatch.setattr(headprune.deploy.onnx, "export_onnx", lambda model, path: path)
    monkeypatch.setattr(headprune.deploy.onnx, "check_onnx", lambda model, path: {"max_abs_diff": 0.5})
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "model")
    assert export_main([str(tmp_path / "model"), "--onnx", str(tmp_path / "m.onnx")]) == 1
    assert "exceeds --tolerance" in capsys.readouterr().err
