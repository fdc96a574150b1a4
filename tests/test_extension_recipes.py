"""docs/extending.md's and architecture.md's recipes are true: a toy metric, recovery and architecture
family are added here the way the pages say, touching only what they name (the function or class, its
registry entry, its yaml in a copy of conf/; for a family one `register_adapter` entry), and then work
from the command line's composition and on a model, with no other list to update (a metric scores a
model with several attention stacks without being listed anywhere; the registry test of
tests/test_scoring.py reads the yaml files, not a set of names)."""
import shutil
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from headprune.apps.config_paths import config_dir
from headprune.apps.config_schema import register_schemas
from headprune.recovery import RECOVERIES
from headprune.recovery.base import Recovery
from headprune.scoring import METRIC_INFO, METRICS, MetricInfo, score_heads, stacked_metrics
from headprune.scoring.reduce import finish_scores
from headprune.tasks import forward_logits


def toy_depth_importance(model, mask, dataloader=None, depth_weight: float = 1.0, max_batches=None):
    """(layers, heads): deeper layers' heads score higher (`depth_weight` per layer), no data used."""
    layers = torch.arange(mask.num_layers, dtype=torch.float64)[:, None]  # (L, 1)
    scores = depth_weight * layers + torch.arange(mask.mask.shape[1], dtype=torch.float64)[None] / 100  # (L, H)
    return finish_scores(scores * torch.ones_like(mask.mask, dtype=torch.float64), mask)


@dataclass
class ToySmoothed(Recovery):
    """Fine-tune on the cross-entropy with label smoothing (extending.md's recovery)."""

    smoothing: float = 0.1

    def __post_init__(self):
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"recovery.smoothing={self.smoothing!r} must be in [0, 1)")

    def training_loss(self, model, batch, task):
        logits = forward_logits(model, batch)  # (B, classes)
        return logits, F.cross_entropy(logits, batch["labels"], label_smoothing=self.smoothing, reduction="none")


@pytest.fixture
def conf(tmp_path):
    """A copy of conf/ to write the recipe's yaml into (the repository's stays as it is)."""
    copy = tmp_path / "conf"
    shutil.copytree(config_dir(), copy)
    yield copy
    register_schemas()  # the schemas as the registries are again, once the monkeypatched entries are gone


def composed(conf, *overrides):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            return compose("train", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def test_a_metric_is_a_function_one_metric_info_line_and_one_yaml(conf, monkeypatch):
    # the recipe: the function (scoring/<family>.py), its MetricInfo line (METRICS is built from it), the yaml
    monkeypatch.setitem(METRIC_INFO, "toy_depth", MetricInfo(toy_depth_importance, "layer index", "keep", "nothing"))
    monkeypatch.setitem(METRICS, "toy_depth", toy_depth_importance)
    (conf / "metric" / "toy_depth.yaml").write_text(
        "# Deeper heads first.\ndefaults:\n  - /schema/metric/toy_depth@_here_\n  - _self_\n\ndepth_weight: 2.0\n")
    register_schemas()  # as headprune-train does on import: the typed schema from the signature
    cfg = composed(conf, "metric=toy_depth")
    assert cfg.metric.depth_weight == 2.0
    with pytest.raises(Exception, match="depth_wieght"):  # a misspelt option fails at compose
        composed(conf, "metric=toy_depth", "metric.depth_wieght=1")
    assert set(METRICS) == {p.stem for p in (conf / "metric").glob("*.yaml")}  # tests/test_scoring.py's check
    from headprune.heads.mask import HeadMask
    from tests.helpers import tiny
    from tests.test_stacks import batch_for, tiny_t5

    bert = tiny("bert")
    scores = instantiate(cfg.metric)(bert, HeadMask.for_model(bert, attach=False), None)
    assert scores.shape[0] == 3 and bool((scores[2] > scores[0]).all())
    # several attention stacks (T5): scored on every site, and named where another metric is refused
    t5 = tiny_t5()
    batch = {k: v for k, v in batch_for("t5").items() if k != "decoder_input_ids"}
    batch["labels"] = torch.tensor([[5, 6, 7, -100], [7, 8, 9, 10]])
    assert torch.isfinite(score_heads(t5, [batch], metric="toy_depth")).all()
    assert "toy_depth" in stacked_metrics()
    with pytest.raises(ValueError, match="allowed for it: .*toy_depth"):
        score_heads(t5, [batch], metric="entropy")


def test_a_recovery_is_a_class_its_registry_entry_and_one_yaml(conf, monkeypatch):
    monkeypatch.setitem(RECOVERIES, "toy_smoothed", ToySmoothed)
    (conf / "recovery" / "toy_smoothed.yaml").write_text(
        "# Fine-tune with label smoothing.\ndefaults:\n  - /schema/recovery/toy_smoothed@_here_\n  - _self_\n\n"
        "smoothing: 0.2\n")
    register_schemas()
    recovery = instantiate(composed(conf, "recovery=toy_smoothed").recovery)
    assert isinstance(recovery, ToySmoothed) and recovery.smoothing == 0.2
    with pytest.raises(Exception, match=r"recovery.smoothing=1.5 must be in \[0, 1\)"):
        instantiate(composed(conf, "recovery=toy_smoothed", "recovery.smoothing=1.5").recovery)
    from tests.helpers import inputs, tiny

    batch = {**inputs(batch=3), "labels": torch.tensor([0, 1, 1])}
    logits, loss = recovery.training_loss(tiny("bert"), batch, None)
    assert logits.shape == (3, 2) and loss.shape == (3,) and bool((loss > 0).all())


def test_a_family_is_one_register_adapter_entry(monkeypatch, tmp_path):
    """adding_an_architecture.md: an unregistered type is refused naming what is missing; one
    `register_adapter(ArchAdapter(...))` entry later it prunes exactly (tools.coverage.check_model:
    removal == mask under eager and sdpa, generate; its reload needs a class transformers knows, which
    this toy subclass outside transformers is not)."""
    import transformers as tf

    from headprune.heads import adapters
    from headprune.heads.adapters import ArchAdapter, get_adapter, register_adapter
    from tools.coverage import check_model

    class ToyConfig(tf.GPT2Config):
        model_type = "toy_gpt2"

    class ToyLM(tf.GPT2LMHeadModel):  # a family of its own to headprune (GPT-2's layout, another model_type)
        config_class = ToyConfig

    def build(attn):
        torch.manual_seed(0)
        config = ToyConfig(vocab_size=64, n_embd=32, n_head=4, n_layer=3, n_positions=64, attn_implementation=attn)
        return ToyLM(config).eval()

    with pytest.raises(NotImplementedError, match="no head adapter for model_type=.toy_gpt2.*GPT2Attention"):
        get_adapter(build("eager"))
    monkeypatch.setattr(adapters, "ADAPTERS", dict(adapters.ADAPTERS))  # the entry is gone after the test
    register_adapter(ArchAdapter(
        name="toy_gpt2", model_types=("toy_gpt2",), layers_path="h", attn_path="attn",
        q="c_attn", k="c_attn", v="c_attn", o="c_proj", heads_attr="n_head",
        size_attrs=(("num_heads", "heads"), ("split_size", "width")),
    ))
    result = check_model(build, "causal_lm", tmp=tmp_path)
    checks = result["checks"]
    assert all(checks[c] == "passes" for c in ("eager", "generate (eager)", "sdpa", "generate (sdpa)")), result
    # the reload reads config.architectures as a transformers class: a real family is one, this toy is not
    assert result["reason"].startswith("reload: ") and "Transformers does not recognize this architecture" in result["reason"] \
        or result["status"] == "passes", result
