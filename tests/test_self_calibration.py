"""Self-generated calibration (data.calibration=self|mix, headprune.data.self_calibration): blocks
sampled from the dense model, seeded and reproducible, cached beside the run and reused on a
re-run, consumed by the repairs (not the corpus), mixed half and half, refused for encoders and for
settings that would be ignored. Tiny Llama built from a config (no download)."""
import json

import pytest
import torch
import transformers as tf

from headprune.apps.train import run
from headprune.data.language_model import TextLMDataModule
from headprune.data.self_calibration import CACHE, SelfCalibration, sample_blocks, top_p_filter
from tests.helpers import compose_train, tiny_llama, tiny_llama_folder, tiny_tokenizer


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A config-only tiny Llama (2 layers, 4 query / 2 KV heads) and a byte tokenizer with BOS."""
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny_llama"))


def _cli(llama_dir, *overrides):
    return [f"model.pretrained={llama_dir}", "model.random_init=true", "model.task=causal_lm", "data=tinyshakespeare",
            "data.block_size=32", "data.score_samples=6", "data.max_train_samples=8", "data.max_validation_samples=4",
            "data.eval_batch_size=4", "schedule=one_shot", "schedule.target_sparsity=0.5", "schedule.baseline_epochs=0",
            "schedule.epochs_per_round=0", "logger=none", "callbacks=none", "diagnostics.enabled=false", "export=false",
            *overrides]


def test_sampling_is_seeded_reproducible_and_leaves_the_global_rng_alone():
    tok = tiny_tokenizer()
    model = tiny_llama(tok)
    rng = torch.get_rng_state()
    a = sample_blocks(model, [tok.bos_token_id], 5, 12, SelfCalibration(seed=3, batch_size=2))
    assert torch.equal(torch.get_rng_state(), rng)
    b = sample_blocks(model, [tok.bos_token_id], 5, 12, SelfCalibration(seed=3, batch_size=2))
    c = sample_blocks(model, [tok.bos_token_id], 5, 12, SelfCalibration(seed=4, batch_size=2))
    assert a.shape == (5, 12) and torch.equal(a, b) and not torch.equal(a, c)
    # sequence i's draws depend on (seed, i) only: fewer samples are the first ones
    assert torch.equal(sample_blocks(model, [tok.bos_token_id], 2, 12, SelfCalibration(seed=3, batch_size=2)), a[:2])
    assert (a[:, 0] == tok.bos_token_id).all() and len({tuple(r) for r in a[:, 1:].tolist()}) == 5


def test_top_p_keeps_the_smallest_set_holding_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.01)).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("calibration,score,train", [("self", (0, 7), (0, 4)), ("mix", (4, 3), (2, 2))])
def test_generated_blocks_replace_all_or_half_of_the_corpus(calibration, score, train, data_dir):
    """self: every score and training block is generated; mix: n // 2 generated after the corpus's rest."""
    tok = tiny_tokenizer()
    dm = TextLMDataModule(tok, file="tinyshakespeare/input.txt", data_dir=data_dir, block_size=16, score_samples=7,
                          name="tinyshakespeare", calibration=calibration,
                          self_calibration={"train_samples": 4})
    dm.setup()
    assert dm.generated_counts() == (score[1], train[1])
    corpus_score = [dm.score_set.ids[s:s + 16] for s in dm.score_set.starts]
    corpus_train = [dm.train_set.ids[s:s + 16] for s in dm.train_set.starts[:train[0]]]
    assert len(corpus_score) == score[0]
    gen_score, gen_train = torch.full((score[1], 16), 300), torch.full((train[1], 16), 301)
    record = dm.use_generated(gen_score, gen_train)
    assert record["score_blocks"] == {"corpus": score[0], "self": score[1]}
    assert record["train_blocks"] == {"corpus": train[0], "self": train[1]}
    got = torch.stack([b["input_ids"] for b in dm.score_set])
    assert torch.equal(got, torch.cat([torch.stack(corpus_score), gen_score]) if corpus_score else gen_score)
    got = torch.stack([b["input_ids"] for b in dm.train_set])
    assert torch.equal(got, torch.cat([torch.stack(corpus_train), gen_train]) if corpus_train else gen_train)


@pytest.mark.parametrize("recovery", ["refit", "least_squares", "bias_compensation"])
def test_the_repair_fits_on_the_generated_blocks(recovery, llama_dir, tmp_path, data_dir, monkeypatch):
    """Every batch the repair reads is a cached generated block, none from Tiny Shakespeare."""
    from headprune.recovery import RECOVERIES

    cls = RECOVERIES[recovery]
    seen = []
    original = cls.reconstruct

    def spy(self, ctx, *args, **kwargs):
        seen.extend(b["input_ids"] for b in ctx.loaders.score)
        return original(self, ctx, *args, **kwargs)

    monkeypatch.setattr(cls, "reconstruct", spy)
    saved = run(compose_train(tmp_path, data_dir, *_cli(llama_dir, f"recovery={recovery}", "data.calibration=self")))
    cached = torch.load(tmp_path / CACHE, weights_only=True)
    assert torch.equal(torch.cat(seen), cached["score"]) and cached["score"].shape == (6, 32)
    record = saved["calibration"]
    assert record["source"] == "self" and record["score_blocks"] == {"corpus": 0, "self": 6}
    assert record["tokens"] == 6 * 32 and record["generated"]["settings"]["seed"] == 0
    assert record["generated"]["reused"] is False and record["generated"]["start_ids"] == [256]


def test_a_rerun_reuses_the_cache_and_other_settings_sample_again(llama_dir, tmp_path, data_dir):
    overrides = _cli(llama_dir, "recovery=least_squares", "data.calibration=mix", "overwrite=true")
    first = run(compose_train(tmp_path, data_dir, *overrides))["calibration"]
    blocks = torch.load(tmp_path / CACHE, weights_only=True)["score"]
    again = json.loads(json.dumps(run(compose_train(tmp_path, data_dir, *overrides))["calibration"]))
    assert again["generated"]["reused"] is True and again["generated"]["sha256"] == first["generated"]["sha256"]
    assert torch.equal(torch.load(tmp_path / CACHE, weights_only=True)["score"], blocks)
    other = run(compose_train(tmp_path, data_dir, *overrides, "data.self_calibration.seed=1"))["calibration"]
    assert other["generated"]["reused"] is False and other["generated"]["sha256"] != first["generated"]["sha256"]
    assert first["score_blocks"] == {"corpus": 3, "self": 3}


def test_the_kl_steps_train_on_generated_blocks(llama_dir, tmp_path, data_dir, monkeypatch):
    from headprune.recovery.distill import Distill

    seen = []
    original = Distill.after_round

    def spy(self, ctx, record):
        seen.extend(b["input_ids"] for b in ctx.loaders.train)
        return original(self, ctx, record)

    monkeypatch.setattr(Distill, "after_round", spy)
    saved = run(compose_train(tmp_path, data_dir, *_cli(llama_dir, "recovery=distill", "recovery.steps=2",
                                                         "data.batch_size=2", "data.calibration=self",
                                                         "data.self_calibration.train_samples=4")))
    cached = torch.load(tmp_path / CACHE, weights_only=True)
    assert cached["train"].shape == (4, 32)
    assert sorted(map(tuple, torch.cat(seen).tolist())) == sorted(map(tuple, cached["train"].tolist()))
    assert saved["calibration"]["train_blocks"] == {"corpus": 0, "self": 4}


@pytest.mark.parametrize("overrides,pattern", [
    (["model=tiny_bert", "data=sst2"], None),
    (["recovery=distill", "recovery.steps=2"], r"needs data.self_calibration.train_samples > 0"),
    (["recovery=refit", "data.self_calibration.train_samples=2"], r"train_samples=2, but this run trains nothing"),
    (["data.calibration=corpus", "data.self_calibration.train_samples=2"], r"with data.calibration=corpus"),
    (["data.calibration=selff"], r"data.calibration='selff'; allowed: corpus, self, mix"),
    (["data.self_calibration.top_p=0"], r"data.self_calibration.top_p=0.0 must be in \(0, 1\]"),
])
def test_bad_settings_are_refused_before_any_work(overrides, pattern, llama_dir, tmp_path, data_dir):
    base = _cli(llama_dir, "data.calibration=self")
    if overrides[0] == "model=tiny_bert":  # an encoder: refused naming data.calibration (sst2 has no such option)
        from headprune.data.self_calibration import check_model
        from tests.helpers import tiny_bert

        with pytest.raises(ValueError, match=r"data.calibration=self samples .* BertForSequenceClassification cannot "
                                             r"generate \(an encoder\)"):
            check_model(tiny_bert(), "self", trains=False, train_samples=0)
        return
    with pytest.raises(ValueError, match=pattern):
        run(compose_train(tmp_path, data_dir, *base, *overrides))
    assert not (tmp_path / "results.json").exists() and not (tmp_path / CACHE).exists()


# -- a real process: killed in the KL steps and resumed; two DDP ranks (gloo) ------------------------------
SELF_KL = [o for o in __import__("tests.test_recovery_fit", fromlist=["KL"]).KL if not o.startswith("recovery.steps")]
SELF_KL += ["recovery.steps=24", "data.calibration=self", "data.self_calibration.train_samples=16",
            "data.self_calibration.batch_size=8"]


@pytest.mark.slow
def test_a_resumed_run_reuses_its_generated_blocks_and_ends_as_the_uninterrupted_one(tmp_path, data_dir):
    """Killed after the KL steps' first checkpoint and resumed with ckpt_path: the resumed run reads
    the run dir's cached blocks (reused, the same digest) and ends with the uninterrupted weights."""
    from tests.test_recovery_fit import _env, _kill_after_first_checkpoint, _same_weights

    whole = run(compose_train(tmp_path / "whole", data_dir, *SELF_KL))
    killed = tmp_path / "killed"
    cmd = [__import__("sys").executable, "-m", "headprune.apps.train", *SELF_KL, f"data.data_dir={data_dir}",
           f"hydra.run.dir={killed}"]
    assert _env()["OMP_NUM_THREADS"] == "1"
    step = _kill_after_first_checkpoint(cmd, killed)
    assert 0 < step < 24 and (killed / CACHE).is_file()
    resumed = run(compose_train(killed, data_dir, *SELF_KL, f"ckpt_path={killed / 'recovery' / 'last.ckpt'}"))
    assert resumed["calibration"]["generated"]["reused"] is True
    assert resumed["calibration"]["generated"]["sha256"] == whole["calibration"]["generated"]["sha256"]
    assert whole["calibration"]["generated"]["reused"] is False
    assert resumed["rounds"][0]["distill"]["resumed_at_step"] == step
    _same_weights(tmp_path / "whole", killed)


@pytest.mark.slow
def test_ddp_ranks_calibrate_on_the_same_generated_blocks(tmp_path, data_dir):
    """Two CPU processes (gloo), no training: rank 0 samples and writes the blocks, rank 1 reads them
    after a barrier, the ranks' digests are compared, and both score and tune least squares on
    their shards of the same blocks (check_consistency: the same masks and weights); the blocks
    equal those of one process."""
    from tests.test_recovery_fit import _finish

    base = [*[o for o in SELF_KL if not o.startswith(("recovery", "data.self_calibration.train"))],
            "recovery=least_squares"]
    one = run(compose_train(tmp_path / "one", data_dir, *base))["calibration"]["generated"]
    out = tmp_path / "ddp"
    _finish([__import__("sys").executable, "-m", "headprune.apps.train", *base, "trainer=ddp", "trainer.devices=2",
             "check_consistency=true", f"data.data_dir={data_dir}", f"hydra.run.dir={out}"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["runtime"]["world_size"] == 2
    assert saved["calibration"]["generated"]["sha256"] == one["sha256"] and saved["calibration"]["source"] == "self"
    assert "mask_tuning" in saved["rounds"][0]


def test_the_settings_are_typed_at_compose(llama_dir, tmp_path, data_dir):
    """data.self_calibration is the SelfCalibration schema: a misspelt field or a wrong type fails at compose."""
    from hydra.errors import ConfigCompositionException

    cfg = compose_train(tmp_path, data_dir, *_cli(llama_dir))
    assert cfg.data.calibration == "corpus" and cfg.data.self_calibration.top_p == 0.95
    for bad in ("data.self_calibration.tempp=1", "data.self_calibration.top_p=abc"):
        with pytest.raises(ConfigCompositionException):
            compose_train(tmp_path, data_dir, *_cli(llama_dir), bad)
