"""deploy/hf.py: pruned models survive save_pruned/load_pruned (uneven heads, other dtypes, a
kill while saving, the umask), damaged or edited folders are named, and uniform GQA layouts load
with plain transformers."""
import json
import os
import stat

import pytest
import torch
import transformers as tf

from headprune import count_params, heads_of_kv_groups, load_pruned, prune_heads, save_pruned
from headprune.atomic import write_json_atomic
from tests.helpers import PRUNE, inputs, llama, tiny, tiny_bert


@torch.no_grad()
def logits(model, batch: dict) -> torch.Tensor:
    return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


@pytest.mark.parametrize("family", ["bert", "distilbert", "gpt2", "llama"])
def test_save_load_round_trip(family, tmp_path):
    model = prune_heads(tiny(family), PRUNE)
    batch = inputs()
    save_pruned(model, tmp_path)
    assert json.loads((tmp_path / "headprune_layout.json").read_text())["layout"] == [[], [0, 2, 3], [0, 1]]

    loaded = load_pruned(tmp_path)
    assert type(loaded) is type(model) and not loaded.training
    assert loaded.headprune_layout == model.headprune_layout
    assert count_params(loaded) == count_params(model)
    torch.testing.assert_close(logits(loaded, batch), logits(model, batch), atol=0, rtol=0)

    wide = load_pruned(tmp_path, dtype=torch.float64, device="cpu", attn_implementation="eager")
    assert wide.dtype == torch.float64 and wide.config._attn_implementation == "eager"
    reference = tiny(family, attn="eager").double()
    prune_heads(reference, PRUNE).load_state_dict(model.state_dict())
    # equal_nan: HF's eager float64 Llama gives NaN at fully padded positions, pruned or not
    torch.testing.assert_close(logits(wide, batch), logits(reference, batch), atol=1e-12, rtol=0, equal_nan=True)

    half = load_pruned(tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    torch.testing.assert_close(logits(half, batch).float(), logits(model, batch), atol=3e-2, rtol=0)


def test_tokenizer_is_saved_when_given(tmp_path, tokenizer):
    save_pruned(prune_heads(tiny_bert(), {1: [0]}), tmp_path, tokenizer=tokenizer)
    assert (tmp_path / "tokenizer_config.json").is_file()


def _killed_while_writing(model, monkeypatch):
    """save_pretrained that writes a 0-byte config.json and is then killed (KeyboardInterrupt)."""
    def killed(self, directory, *args, **kwargs):
        from pathlib import Path

        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text("")
        raise KeyboardInterrupt("killed while writing the export")

    monkeypatch.setattr(type(model), "save_pretrained", killed)


def test_a_kill_while_saving_leaves_no_half_written_folder(tmp_path, monkeypatch):
    """The folder appears complete or not at all; with overwrite=True the old model stays whole
    until the new one is complete."""
    model = prune_heads(tiny("bert"), PRUNE)
    save_pruned(model, tmp_path / "kept")
    before = {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()}
    _killed_while_writing(model, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        save_pruned(model, tmp_path / "new")
    with pytest.raises(KeyboardInterrupt):
        save_pruned(model, tmp_path / "kept", overwrite=True)
    assert not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in (tmp_path / "kept").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # no temporary folder left behind
    monkeypatch.undo()
    save_pruned(prune_heads(tiny("bert"), {0: [1]}), tmp_path / "kept", overwrite=True)
    assert load_pruned(tmp_path / "kept").headprune_layout == [[0, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def test_saved_files_get_0666_less_the_umask(tmp_path, tokenizer):
    """model.safetensors and every other file written: 0666 & ~umask, as the README promises."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        save_pruned(prune_heads(tiny_bert(), {1: [0]}), tmp_path / "export", tokenizer=tokenizer)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "export").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE((tmp_path / "export").stat().st_mode) == 0o755


def _edit_layout(folder, layer: int, kept: list) -> None:
    path = folder / "headprune_layout.json"
    saved = json.loads(path.read_text())
    saved["layout"][layer] = kept
    path.write_text(json.dumps(saved))


@pytest.mark.parametrize("size", ["empty", "half"])
def test_a_truncated_weights_file_is_named(size, tmp_path):
    """load_pruned and build_model (a run's model.pretrained folder) name the broken file."""
    from headprune.models.build import build_model

    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "uneven")
    save_pruned(tiny("bert"), tmp_path / "plain")
    (tmp_path / "plain" / "headprune_layout.json").unlink()  # loads through plain from_pretrained
    for folder in (tmp_path / "uneven", tmp_path / "plain"):
        weights = folder / "model.safetensors"
        weights.write_bytes(b"" if size == "empty" else weights.read_bytes()[: weights.stat().st_size // 2])
        with pytest.raises(ValueError, match=rf"{weights}.*(truncated|cannot be read)"):
            load_pruned(folder)
        with pytest.raises(ValueError, match=rf"{weights}.*(truncated|cannot be read)"):
            build_model(str(folder), num_labels=2)


@pytest.mark.parametrize("layer, kept, pattern", [
    (1, [0, 0, 3], r"headprune_layout.json.*layer 1.*head 0 twice"),
    (1, [0, 2, 9], r"headprune_layout.json.*layer 1.*head 9.*0\.\.3"),
    (1, [0, 1, 2, 3], r"headprune_layout.json.*layer 1 keeps 4 heads.*model.safetensors.*layer\.1\."),
    (2, [0], r"headprune_layout.json.*layer 2 keeps 1 heads.*model.safetensors.*layer\.2\."),
])
def test_an_edited_layout_is_refused(layer, kept, pattern, tmp_path):
    """A duplicate or out-of-range head id, or head counts the weights' shapes contradict: refused,
    naming the layout file and the layer, instead of loading with heads re-initialised."""
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path)
    _edit_layout(tmp_path, layer, kept)
    with pytest.raises(ValueError, match=pattern):
        load_pruned(tmp_path)


def test_save_pruned_refuses_a_folder_with_files_unless_told(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")  # an old tokenizer
    model = prune_heads(tiny("bert"), PRUNE)
    with pytest.raises(FileExistsError, match=r"is not empty.*overwrite=True"):
        save_pruned(model, tmp_path)
    save_pruned(model, tmp_path, overwrite=True)
    assert not (tmp_path / "tokenizer.json").exists() and (tmp_path / "headprune_layout.json").is_file()


def test_written_files_respect_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path / "m")
        write_json_atomic(tmp_path / "results.json", {"a": 1})
    finally:
        os.umask(old)
    for path in (tmp_path / "m" / "headprune_layout.json", tmp_path / "results.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


@pytest.mark.parametrize("damage,pattern", [
    ("missing", r"holds weights of a pruned model but no headprune_layout\.json"),
    ("truncated", r"headprune_layout\.json is not valid JSON"),
    ("no_key", r"headprune_layout\.json has no 'layout' entry"),
])
def test_load_pruned_names_a_damaged_layout_file(damage, pattern, tmp_path):
    save_pruned(prune_heads(tiny("bert"), PRUNE), tmp_path)
    layout = tmp_path / "headprune_layout.json"
    if damage == "missing":
        layout.unlink()
    elif damage == "truncated":
        layout.write_text(layout.read_text()[:20])
    else:
        layout.write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError, match=pattern):
        load_pruned(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"holds no model \(no config\.json\)"):
        load_pruned(tmp_path / "nowhere")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_uniform_gqa_layouts_load_with_plain_transformers(family, tmp_path):
    """The same KV groups' worth of heads in every layer: save_pruned writes a standard checkpoint
    (config with the new head counts) that AutoModelForCausalLM loads with no headprune code."""
    model = tiny(family)
    prune_heads(model, heads_of_kv_groups(model, {0: [0], 1: [1], 2: [0]}))
    saved = save_pruned(model, tmp_path)
    sidecar = json.loads((tmp_path / "headprune_layout.json").read_text())  # the one sidecar, saying plain_hf
    assert saved.plain_hf and sidecar["plain_hf"] and not (tmp_path / "headprune_export.json").exists()
    assert model.config.num_attention_heads == 4  # the live model's config still describes the original
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (plain.config.num_attention_heads, plain.config.num_key_value_heads) == (2, 1)
    batch = inputs()
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, model(**batch).logits, atol=1e-6, rtol=0)
    assert sidecar["layout"] == [[2, 3], [0, 1], [2, 3]]  # the original ids of the heads kept
    assert sidecar["kv_modes"]["modes"] == [["removed", "full"], ["full", "removed"], ["removed", "full"]]


@pytest.mark.parametrize("family,heads,why", [
    ("llama", PRUNE, "a layer has no heads"),
    ("llama", {0: [0]}, "a KV group partly kept"),
    ("llama", {0: [0, 1]}, "layers keep different numbers of heads"),
    ("bert", {0: [0]}, "config has no head_dim of its own"),
])
def test_other_layouts_say_they_need_load_pruned(family, heads, why, tmp_path):
    saved = save_pruned(prune_heads(tiny(family), heads), tmp_path)
    assert not saved.plain_hf and why in saved.why and (tmp_path / "headprune_layout.json").is_file()


def test_a_uniform_layout_its_config_class_refuses_is_saved_with_its_layout():
    """transformers 5 validates that the hidden size is a multiple of the query heads: 6 of 8 heads
    kept in a hidden size of 64 cannot be a plain config, so the folder carries its layout and still
    loads, with the same logits."""
    from headprune import load_pruned, prune_heads, save_pruned

    model = llama(vocab_size=64, hidden_size=64, num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    prune_heads(model, [(layer, h) for layer in range(2) for h in (6, 7)])
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        saved = save_pruned(model, Path(tmp) / "export")
        assert not saved.plain_hf and "refuses 6 query / 6 KV heads" in saved.why
        again = load_pruned(Path(tmp) / "export").eval()
        ids = torch.randint(0, 64, (2, 7))
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
