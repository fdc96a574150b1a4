"""recovery/teacher_cache.py: the teacher's top-k distributions computed once replace its forward at
every KL step: exact when k covers the vocabulary, a lower bound otherwise, and a step budget
trained on them recovers as the live teacher does."""
import pytest
import torch
from torch.utils.data import DataLoader

from headprune.engine.step_fit import EXAMPLE_INDEX
from headprune.recovery import Distill
from headprune.recovery.distill import kd_loss
from headprune.recovery.teacher_cache import build_teacher_cache, cached_kd_loss
from headprune.results import RunResults
from headprune.scoring import get_metric
from headprune.selection.layer_policies import UniformPolicy
from headprune.selection.pruner import Loaders, Pruner
from headprune.selection.schedules import OneShot
from headprune.tasks import CAUSAL_LM
from tests.helpers import V, tiny


def _examples(n: int, tokens: int = 12, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (n, tokens), generator=g)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]


def _loader(n: int, seed: int = 0) -> DataLoader:
    return DataLoader(_examples(n, seed=seed), batch_size=2, shuffle=True)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_a_cache_of_the_whole_vocabulary_is_the_exact_kl_and_a_smaller_one_a_lower_bound(temperature):
    teacher, student = tiny("llama", seed=0).eval(), tiny("llama", seed=1).eval()
    loader = _loader(6)
    batch = {**loader.collate_fn([loader.dataset[i] for i in (4, 1)]), EXAMPLE_INDEX: torch.tensor([4, 1])}
    with torch.no_grad():
        exact = kd_loss(student(input_ids=batch["input_ids"]).logits, teacher(input_ids=batch["input_ids"]).logits,
                        batch, temperature, CAUSAL_LM)
        logits = student(input_ids=batch["input_ids"]).logits
        full = cached_kd_loss(logits, build_teacher_cache(teacher, loader, CAUSAL_LM, temperature, V), batch,
                              temperature, CAUSAL_LM)
        top4 = cached_kd_loss(logits, build_teacher_cache(teacher, loader, CAUSAL_LM, temperature, 4), batch,
                              temperature, CAUSAL_LM)
    torch.testing.assert_close(full, exact, atol=1e-5, rtol=1e-5)
    assert (top4 <= exact + 1e-4).all() and (top4 > 0).all()
    with pytest.raises(ValueError, match="built at temperature"):
        cached_kd_loss(logits, build_teacher_cache(teacher, loader, CAUSAL_LM, temperature, 4), batch,
                       temperature + 1.0, CAUSAL_LM)


def _distill(teacher_logits: str, tmp_path):
    model = tiny("llama")
    distill = Distill(steps=6, lr=1e-3, alpha=1.0, temperature=1.0, teacher_logits=teacher_logits,
                      teacher_topk=V if teacher_logits == "cached" else None)
    pruner = Pruner(model, get_metric("magnitude"), OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0),
                    UniformPolicy(), None, distill, results=RunResults(tmp_path))
    record = pruner.step(0, Loaders(_loader(4), _loader(4, seed=1), train=_loader(8, seed=2)))
    held = pruner.dense is not None, distill.state.model is not None
    return model, {**record["distill"], "held": held}


def test_steps_on_the_cached_teacher_train_as_the_live_teacher_does(tmp_path):
    """Six KL steps of a pruned tiny Llama: with the cache (k = vocabulary) no teacher forward runs
    during the steps and no unpruned copy is held (the run freed it once the cache was built), and
    the weights and losses match the live teacher's to float rounding."""
    live_model, live = _distill("live", tmp_path / "live")
    cached_model, cached = _distill("cached", tmp_path / "cached")
    assert live["teacher_seconds"] > 0 and "teacher_seconds" not in cached
    assert live["held"] == (True, True) and cached["held"] == (False, False)  # the unpruned copy was freed
    assert cached["teacher"] == f"cached top-{V}" and cached["teacher_cache_seconds"] >= 0
    assert cached["loss_first"] == pytest.approx(live["loss_first"], rel=1e-5, abs=1e-6)
    assert cached["loss_last"] == pytest.approx(live["loss_last"], rel=1e-5, abs=1e-6)
    for a, b in zip(live_model.parameters(), cached_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kwargs,pattern", [
    ({"teacher_logits": "disk"}, r"recovery.teacher_logits='disk' is not allowed; allowed: live"),
    ({"teacher_logits": "cached", "teacher_topk": 0}, r"recovery.teacher_topk=0 must be an integer >= 1"),
    ({"teacher_topk": 16}, r"recovery.teacher_topk=16 sizes the cached teacher, but recovery.teacher_logits='live'"),
    ({"teacher_logits": "cached", "hidden_weight": 0.5}, r"teacher_logits=cached keeps the teacher's output"),
    ({"checkpoint_every": -1}, r"recovery.checkpoint_every=-1 must be an integer >= 0"),
    ({"teacher_logits": "cached", "steps": 0}, r"teacher_logits=cached serves a step budget"),
])
def test_bad_cache_settings_name_the_field(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        Distill(**{"steps": 2, **kwargs})
