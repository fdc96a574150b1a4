"""Causal-LM path: byte tokenizer, the text-block data module, and the Hydra app on a tiny
random-init GPT-2 (model=tiny_gpt2 data=tinyshakespeare): perplexity in results.json, every
metric scoring an LM, and an export that reloads with the trained model's logits."""
import json
import math

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import headprune.apps.train as train_app
from headprune import head_layout, load_pruned
from headprune.models.byte_tokenizer import ByteTokenizer
from headprune.apps.config_paths import config_dir
from headprune.tasks import evaluate
from headprune.data.language_model import TextLMDataModule, split_blocks
from headprune.models import load_tokenizer
from headprune.apps.train import run

TINY_GPT2 = ["model=tiny_gpt2", "data=tinyshakespeare", "+model.config_overrides.n_layer=2",
             "+model.config_overrides.n_head=4", "+model.config_overrides.n_embd=32",
             "+model.config_overrides.n_positions=64", "data.block_size=32", "data.max_train_samples=48", "data.score_samples=16", "data.max_validation_samples=16",
             "data.batch_size=8", "data.eval_batch_size=8", "logger=none", "callbacks=none",
             "trainer.num_sanity_val_steps=0"]


@pytest.fixture
def cfg_factory(tmp_path, data_dir):
    def make(*overrides):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose("train", overrides=[f"paths.output_dir={tmp_path}", f"data.data_dir={data_dir}", *overrides])
    yield make
    GlobalHydra.instance().clear()


def _results(path):
    return json.loads((path / "results.json").read_text())


# -- byte tokenizer ------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "First Citizen:\nBefore we proceed", "naïve café — 東京 🙂", "\x00\xff tab\t"])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_special_tokens=True)) == text  # BOS dropped on decode
    assert tok.decode(torch.tensor(ids + [tok.pad_token_id])) == text


def test_byte_tokenizer_specials_and_saving(tmp_path):
    tok = ByteTokenizer()
    assert len(tok) == tok.vocab_size == 258 and tok.bos_token_id == tok.eos_token_id == 256
    assert tok.decode([104, 105, 256, 33], skip_special_tokens=False) == "hi<|endoftext|>!"
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character
    with pytest.raises(ValueError, match="outside the byte tokenizer's vocabulary 0..257"):
        tok.decode([300])
    tok.save_pretrained(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)
    assert isinstance(load_tokenizer("byte-gpt2"), ByteTokenizer)


# -- blocks and splits ---------------------------------------------------------------------------
def test_split_blocks_are_contiguous_disjoint_and_seeded():
    n, size = 10_000, 64
    parts = split_blocks(n, size, validation_share=0.1, score_samples=20, seed=3)
    cut = 9_000
    assert all(s + size <= cut for s in parts["train"] + parts["score"])
    assert all(s >= cut and s + size <= n for s in parts["validation"])
    assert len(parts["validation"]) == 1_000 // size and len(parts["score"]) == 20
    spans = sorted(parts["train"] + parts["score"])
    assert spans == list(range(0, cut - size + 1, size))  # the training part, tiled without overlap
    assert not set(parts["train"]) & set(parts["score"])
    assert parts == split_blocks(n, size, 0.1, 20, seed=3)
    assert parts["score"] != split_blocks(n, size, 0.1, 20, seed=4)["score"]


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(score_samples=500), r"data\.score_samples=500 leaves no training data"),
    (dict(validation_share=0.001), r"data\.validation_share=0\.001"),
])
def test_split_blocks_errors_name_the_field(kwargs, pattern):
    args = dict(n_tokens=10_000, block_size=64, validation_share=0.1, score_samples=8, seed=0) | kwargs
    with pytest.raises(ValueError, match=pattern):
        split_blocks(**args)


def test_lm_data_module_on_tinyshakespeare(data_dir):
    tok = ByteTokenizer()
    dm = TextLMDataModule(tok, file="tinyshakespeare/input.txt", data_dir=str(data_dir), block_size=128,
                          score_samples=64, max_validation_samples=100, seed=0)
    dm.setup()
    data = (data_dir / "tinyshakespeare" / "input.txt").read_bytes()
    cut = round(0.9 * len(data))
    assert len(dm.train_set) + len(dm.score_set) == cut // 128 and len(dm.val_set) == 100
    assert not set(dm.train_set.starts) & set(dm.score_set.starts)
    assert max(dm.train_set.starts + dm.score_set.starts) + 128 <= cut <= min(dm.val_set.starts)
    block = dm.val_set[5]["input_ids"]
    start = dm.val_set.starts[5]
    assert block.shape == (128,) and bytes(block.tolist()) == data[start:start + 128]
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids"} and batch["input_ids"].shape == (32, 128)
    with pytest.raises(ValueError, match=r"data\.block_size=1 "):
        TextLMDataModule(tok, block_size=1)


# -- the app -------------------------------------------------------------------------------------
def test_fast_dev_run_reports_perplexity(cfg_factory, tmp_path):
    run(cfg_factory(*TINY_GPT2, "debug=fast"))
    res = _results(tmp_path)
    assert res["model"] == {"layers": 2, "heads": 4}
    for val in (res["baseline"]["val"], res["rounds"][0]["val"], res["final"]["val"]):
        assert set(val) == {"loss", "ppl"} and val["ppl"] == pytest.approx(math.exp(val["loss"]))
    assert res["baseline"]["val"]["ppl"] > 50  # random init over 258 tokens
    assert res["final"]["params"]["total"] < res["baseline"]["params"]["total"]


def test_pruned_export_reloads_with_the_trained_models_logits(cfg_factory, tmp_path, monkeypatch):
    saved, save_pruned = {}, train_app.save_pruned

    def keep_model(model, directory, **kwargs):  # the trained model, pruned in place
        saved["model"] = model
        return save_pruned(model, directory, **kwargs)

    monkeypatch.setattr(train_app, "save_pruned", keep_model)
    run(cfg_factory(*TINY_GPT2, "schedule=iterative", "schedule.target_sparsity=0.5", "schedule.step=0.25",
                    "schedule.baseline_epochs=1", "schedule.epochs_per_round=1", "optim.optimizer.lr=1e-3"))
    res = _results(tmp_path)
    assert [r["sparsity"] for r in res["rounds"]] == [0.25, 0.5] and res["final"]["stop_reason"] == "target_reached"
    assert res["final"]["val"]["ppl"] < res["baseline"]["val"]["ppl"] * 2

    export = tmp_path / "export"
    loaded = load_pruned(export).eval()
    assert [len(kept) for kept in head_layout(loaded)] == res["final"]["heads_per_layer"]
    assert isinstance(load_tokenizer(str(export)), ByteTokenizer)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    trained = saved["model"].eval()
    with torch.no_grad():
        assert torch.equal(trained(input_ids=ids).logits, loaded(input_ids=ids).logits)
    dm = TextLMDataModule(ByteTokenizer(), file="tinyshakespeare/input.txt", data_dir=res["config"]["data"]["data_dir"],
                          block_size=32, score_samples=16, max_validation_samples=16, eval_batch_size=8)
    dm.setup()
    assert evaluate(loaded, dm.val_dataloader())["ppl"] == pytest.approx(res["final"]["val"]["ppl"], rel=1e-5)


@pytest.mark.parametrize("metric", ["taylor", "fisher", "lrp", "entropy", "confidence", "magnitude", "l0_gates"])
def test_every_metric_scores_a_causal_lm(metric, cfg_factory, tmp_path):
    extra = ["metric.steps=2"] if metric == "l0_gates" else []
    res = run(cfg_factory(*TINY_GPT2, f"metric={metric}", *extra, "schedule=one_shot", "schedule.target_sparsity=0.5",
                          "schedule.baseline_epochs=0", "schedule.epochs_per_round=0", "export=false",
                          "diagnostics.enabled=false"))
    (round1,) = res["rounds"]
    scores = torch.tensor(round1["scores"])
    assert scores.shape == (2, 4) and torch.isfinite(scores).all()
    assert round1["n_pruned"] == 4 and set(round1["val"]) == {"loss", "ppl"}


@pytest.mark.parametrize("overrides,pattern", [
    (["schedule=until_threshold"], r"schedule\.metric='acc' is not reported by a model\.task=causal_lm run "
                                   r"\(its validation metrics: loss, ppl\)"),
    (["data=sst2"], r"model\.task=causal_lm does not fit data=sst2.*allowed: model\.task=classification"),
    (["data.block_size=128"], r"data\.block_size=128 exceeds the model's 64 positions"),
    (["model.random_init=false"], r"model\.pretrained='byte-gpt2' is a built-in config without weights"),
])
def test_bad_causal_lm_settings_name_the_field(overrides, pattern, cfg_factory):
    other_data = overrides[0].startswith("data=")
    base = [o for o in TINY_GPT2 if not (other_data and o.startswith("data"))]
    with pytest.raises(ValueError, match=pattern):
        run(cfg_factory(*base, "debug=fast", *overrides))


# -- headprune-collect -----------------------------------------------------------------------------
def _fake_run(folder, val_before, vals):
    rounds = [{"round": i + 1, "sparsity": 0.25 * (i + 1), "val_before_finetune": v, "val": v}
              for i, v in enumerate(vals)]
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"baseline": {"val": val_before}, "rounds": rounds, "model": {},
                                                     "final": {"sparsity": 0.5, "val": vals[-1], "stop_reason": "x"}}))


def test_collect_reports_perplexity_for_lm_runs_and_accuracy_otherwise(tmp_path):
    from headprune.apps.collect import collect

    _fake_run(tmp_path / "lm" / "0", {"loss": 1.0, "ppl": 2.72}, [{"loss": 1.1, "ppl": 3.0}, {"loss": 1.2, "ppl": 3.32}])
    collect([tmp_path / "lm"], tmp_path / "out_lm")
    assert "| 2.720 | 0.500 | 3.320 | 1.221 |" in (tmp_path / "out_lm" / "results.md").read_text()
    assert "ppl_before_finetune" in (tmp_path / "out_lm" / "runs.csv").read_text()
    assert (tmp_path / "out_lm" / "perplexity_vs_sparsity.png").is_file()

    _fake_run(tmp_path / "cls" / "0", {"acc": 0.9, "loss": 0.3}, [{"acc": 0.88, "loss": 0.35}])
    collect([tmp_path / "cls"], tmp_path / "out_cls")
    assert "ppl" not in (tmp_path / "out_cls" / "runs.csv").read_text().splitlines()[0]
    assert (tmp_path / "out_cls" / "accuracy_vs_sparsity.png").is_file()
