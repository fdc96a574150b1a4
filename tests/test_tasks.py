"""tasks.py: one Task object per task, chosen from config by name or from a model by its head,
never from the shape of the logits; its loss, weights, metrics and evaluation agree."""
import math

import pytest
import torch
import torch.nn.functional as F

from headprune.tasks import CAUSAL_LM, CLASSIFICATION, get_task, headline, task_of
from tests.helpers import tiny, tiny_bert


def test_a_model_s_head_decides_its_task():
    assert task_of(tiny("llama")) is CAUSAL_LM and task_of(tiny("gpt2")) is CAUSAL_LM
    assert task_of(tiny_bert()) is CLASSIFICATION
    assert get_task("causal_lm") is CAUSAL_LM and get_task("classification") is CLASSIFICATION
    with pytest.raises(ValueError, match=r"model.task='lm' is not allowed; allowed: classification, causal_lm"):
        get_task("lm")


def test_causal_lm_loss_weights_and_perplexity_agree():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)  # (B, T, V)
    batch = {"input_ids": torch.randint(0, 7, (2, 5), generator=g),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    token = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")  # (B, T-1)
    want = torch.stack([token[0].mean(), token[1, :2].mean()])
    torch.testing.assert_close(CAUSAL_LM.loss(logits, batch), want)
    torch.testing.assert_close(CAUSAL_LM.weights(batch), torch.tensor([4.0, 2.0]))
    totals = [0.0, 0.0, 0.0]
    CAUSAL_LM.accumulate(logits, batch, totals)
    per_token = float((want * torch.tensor([4.0, 2.0])).sum() / 6)
    assert CAUSAL_LM.metrics(*totals) == pytest.approx({"loss": per_token, "ppl": math.exp(per_token)})


def test_classification_loss_and_accuracy():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])  # (B, C)
    batch = {"input_ids": torch.zeros(3, 4, dtype=torch.long), "labels": torch.tensor([0, 1, 1])}
    torch.testing.assert_close(CLASSIFICATION.loss(logits, batch), F.cross_entropy(logits, batch["labels"], reduction="none"))
    totals = [0.0, 0.0, 0.0]
    CLASSIFICATION.accumulate(logits, batch, totals)
    assert CLASSIFICATION.metrics(*totals)["acc"] == pytest.approx(2 / 3)
    assert torch.equal(CLASSIFICATION.weights(batch), torch.ones(3))


def test_headline_is_the_task_s():
    assert headline({"acc": 0.9, "loss": 0.3}) == ("acc", 0.9)
    assert headline({"loss": 2.0, "ppl": 7.4}) == ("ppl", 7.4)
    assert CLASSIFICATION.higher_is_better and not CAUSAL_LM.higher_is_better
