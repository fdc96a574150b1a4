"""Head diagnostics: JS-distance redundancy, special-token share, and the end-of-run report."""
import json
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import WandbLogger

from headprune.scoring.diagnostics import head_diagnostics, js_distances, special_token_ids
from headprune.heads.mask import HeadMask
from headprune.lightning.callbacks import HeadPruning
from headprune.selection.pruner import Pruner
from headprune.data.classification import TextClassificationDataModule
from headprune.lightning.module import HeadPruneModule
from headprune.results import RunResults
from headprune.scoring.taylor import taylor_importance
from headprune.selection.layer_policies import GlobalPolicy
from headprune.selection.schedules import OneShot
from headprune.runs.spec import DiagnosticsSpec
from tests.helpers import tiny_batch, tiny_bert

from headprune.heads.surgery import prune_heads


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def _peaked_bert(duplicate: bool = True):
    """Tiny BERT with sharp attention (scaled Q/K); in layer 0, head 1 is a copy of head 0."""
    model = tiny_bert()
    with torch.no_grad():
        for block in model.bert.encoder.layer:
            for proj in (block.attention.self.query, block.attention.self.key):
                proj.weight.mul_(30)
        if duplicate:
            core = model.bert.encoder.layer[0].attention.self
            for proj in (core.query, core.key):
                proj.weight[8:16] = proj.weight[0:8]
                proj.bias[8:16] = proj.bias[0:8]
    return model


def test_js_distance_matches_the_definition():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(2, 3, 5, 5, generator=g).softmax(-1)  # (B, h, T, T)
    real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    p = p * real[:, None, None, :]
    p = p / p.sum(-1, keepdim=True)
    got = js_distances(p, real)  # (B, h, h)
    for b in range(2):
        n = int(real[b].sum())
        for i in range(3):
            for j in range(3):
                d = 0.0
                for q in range(n):
                    pi, pj = p[b, i, q, :n].double(), p[b, j, q, :n].double()
                    m = (pi + pj) / 2
                    jsd = 0.5 * (pi * (pi / m).log2()).sum() + 0.5 * (pj * (pj / m).log2()).sum()
                    d += math.sqrt(max(float(jsd), 0.0))
                assert got[b, i, j].item() == pytest.approx(d / n, abs=1e-5)
    # bounds: identical rows are 0 apart, disjoint rows 1
    one_hot = torch.eye(2)[None, :, None, :].expand(1, 2, 2, 2)  # head 0 looks at key 0, head 1 at key 1
    torch.testing.assert_close(js_distances(one_hot, torch.ones(1, 2, dtype=torch.bool))[0],
                               torch.tensor([[0.0, 1.0], [1.0, 0.0]]))


def test_near_duplicate_heads_are_reported(tokenizer):
    model = _peaked_bert()
    mask = HeadMask.for_model(model)
    diag = head_diagnostics(model, mask, [tiny_batch(tokenizer)], tokenizer=tokenizer, duplicate_threshold=0.1)
    assert diag.near_duplicates() == [{"layer": 0, "heads": [0, 1], "js_distance": 0.0}]
    js = diag.js_distance
    torch.testing.assert_close(js, js.transpose(1, 2))
    assert (js.diagonal(dim1=1, dim2=2).abs() < 1e-5).all() and (js >= 0).all() and (js <= 1).all()
    assert diag.redundancy()[0, :2].max() < 1e-4 and diag.redundancy()[1:].min() > 0.1


def test_special_token_share_matches_a_hand_computation(tokenizer):
    batch = tiny_batch(tokenizer)
    assert (batch["attention_mask"] == 0).any()
    assert special_token_ids(tiny_bert(), tokenizer) == sorted([tokenizer.cls_token_id, tokenizer.sep_token_id])
    reference = tiny_bert("eager")
    with torch.no_grad():
        maps = reference(**_inputs(batch), output_attentions=True).attentions
    expected = torch.zeros(3, 4, dtype=torch.float64)
    n = batch["input_ids"].shape[0]
    for b in range(n):
        length = int(batch["attention_mask"][b].sum())
        special = [k for k in range(length) if int(batch["input_ids"][b, k]) in (101, 102)]
        for layer, a in enumerate(maps):
            expected[layer] += a[b, :, :length, special].sum(-1).mean(-1).double()  # (H,)
    expected /= n
    model = tiny_bert()
    diag = head_diagnostics(model, HeadMask.for_model(model), [batch], tokenizer=tokenizer, special_threshold=0.3)
    torch.testing.assert_close(diag.special_token_share, expected, rtol=1e-5, atol=1e-6)
    assert {(d["layer"], d["head"]) for d in diag.degenerate_heads()} == \
        {tuple(x) for x in (expected >= 0.3).nonzero().tolist()}
    # an explicit special_tokens_mask in the batch wins over token ids
    only_cls = dict(batch, special_tokens_mask=(batch["input_ids"] == 101).long())
    cls_share = head_diagnostics(model, HeadMask.for_model(model), [only_cls], metrics=[]).special_token_share
    assert (cls_share < diag.special_token_share).all()


@pytest.mark.parametrize("physical", [False, True])
def test_pruned_heads_are_left_out_and_json_is_strict(physical, tokenizer):
    model = _peaked_bert()
    pruned = [(0, 2), (2, 0), (2, 1), (2, 2)]
    mask = HeadMask.for_model(model)
    mask.prune(pruned)
    batch = tiny_batch(tokenizer)
    masked = head_diagnostics(model, mask, [batch], tokenizer=tokenizer)
    if physical:
        mask.detach()
        prune_heads(model, pruned)
        mask = HeadMask.for_model(model)
        mask.prune(pruned)
    diag = head_diagnostics(model, mask, [batch], tokenizer=tokenizer)
    report = diag.to_json()
    json.dumps(report, allow_nan=False)
    assert report["special_tokens"]["share"][0][2] is None and report["redundancy"]["min_js_distance"][2][3] is None
    assert report["redundancy"]["js_distance"][0][0][2] is None
    assert set(report["importance"]) == {"entropy", "confidence", "magnitude"}
    assert report["importance"]["entropy"][2][0] is None and report["examples"] == batch["input_ids"].shape[0]
    assert math.isnan(diag.redundancy()[2, 3])  # the only head left in layer 2 has no neighbour
    if physical:
        torch.testing.assert_close(diag.js_distance, masked.js_distance, equal_nan=True, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(diag.special_token_share, masked.special_token_share, equal_nan=True,
                                   rtol=1e-4, atol=1e-6)


def test_bad_diagnostics_options_name_the_field(tokenizer):
    model = tiny_bert()
    with pytest.raises(ValueError, match=r"diagnostics\.metrics=.*allowed: .*taylor"):
        head_diagnostics(model, HeadMask.for_model(model), [tiny_batch(tokenizer)], metrics=["nope"])
    with pytest.raises(ValueError, match=r"diagnostics\.duplicate_threshold=2"):
        head_diagnostics(model, HeadMask.for_model(model), [tiny_batch(tokenizer)], duplicate_threshold=2)
    assert DiagnosticsSpec(enabled=False).options() is None
    assert DiagnosticsSpec(metrics=[]).options() == {"metrics": [], "duplicate_threshold": 0.2,
                                                     "special_threshold": 0.8}
    with pytest.raises(ValueError, match=r"diagnostics\.metrics=\['nope'\].*allowed: .*taylor"):
        DiagnosticsSpec(metrics=["nope"])  # a run's settings are refused when its spec is built, before any work


class RecordingWandb(WandbLogger):
    """A WandbLogger that only records what it is asked to log."""

    def __init__(self):
        self.images, self.metrics, self.summary = [], [], {}

    @property
    def experiment(self):
        return SimpleNamespace(summary=self.summary)

    def log_image(self, key, images, step=None, **kwargs):
        self.images.append((key, len(images)))

    def log_metrics(self, metrics, step=None):
        self.metrics.append(metrics)


def test_end_of_run_diagnostics_in_results_heatmaps_and_wandb(tokenizer, data_dir, tmp_path):
    dm = TextClassificationDataModule(tokenizer, train_file="sst2/train.tsv", validation_file="sst2/validation.tsv",
                                      data_dir=str(data_dir), score_samples=16, max_train_samples=8,
                                      max_validation_samples=16, eval_batch_size=8, max_length=32)
    dm.setup()
    module = HeadPruneModule(tiny_bert(), num_labels=2)
    results = RunResults(tmp_path)
    pruner = Pruner(module.model, partial(taylor_importance, normalize=True),
                    OneShot(target_sparsity=0.25, baseline_epochs=0, epochs_per_round=0),
                    GlobalPolicy(min_heads_per_layer=1), mask=module.head_mask, results=results)
    pruning = HeadPruning(pruner, diagnostics={"metrics": ["entropy", "magnitude"], "duplicate_threshold": 0.2})
    wandb = RecordingWandb()
    trainer = SimpleNamespace(loggers=[wandb], global_step=0, fast_dev_run=False, world_size=1, global_rank=0,
                              current_epoch=0, datamodule=dm,
                              optimizers=[], strategy=SimpleNamespace(),
                              is_global_zero=True)
    pruning.on_train_start(trainer, module)
    pruning.finish(module, dm, trainer)

    saved = json.loads((tmp_path / "results.json").read_text())["diagnostics"]
    assert saved["examples"] == 16 and saved["redundancy"]["duplicate_threshold"] == 0.2
    assert set(saved["importance"]) == {"entropy", "magnitude", "taylor_round1"}
    assert saved["special_tokens"]["ids"] == [101, 102]
    pruned = json.loads((tmp_path / "results.json").read_text())["final"]["pruned"]
    assert all(saved["special_tokens"]["share"][l][h] is None for l, h in pruned)
    stems = ["importance_entropy", "importance_magnitude", "importance_taylor_round1", "redundancy",
             "special_token_share"]
    assert all((tmp_path / f"{s}.png").is_file() for s in stems)
    assert sorted(key for key, _ in wandb.images if key.startswith("diagnostics/")) == \
        sorted(f"diagnostics/{s}" for s in stems)
