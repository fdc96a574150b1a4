"""The gradient metrics' causal-LM loss with the output head on chunks of positions
(lm_head_chunks): the same per-token losses and the same gate gradients as the full logits, no
chunk larger than its bound, and the full logits where the model changes them after its head
(Gemma 2's soft-capping)."""
import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from headprune import lm_head_chunks
from headprune.heads.mask import HeadMask
from headprune.lm_head_chunks import chunked_token_loss
from headprune.scoring.fisher import fisher_importance
from headprune.tasks import CAUSAL_LM
from tests.helpers import MORE_FAMILIES, llama

T = 40


def _ids(vocab: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, T), generator=torch.Generator().manual_seed(1))


def test_chunks_give_the_full_logits_losses_with_no_chunk_over_its_bound():
    model = llama(seed=0, attn="sdpa")
    ids = _ids(model.config.vocab_size)
    targets = ids[:, 1:].clone()
    targets[0, :5] = -100  # unscored targets stay 0
    bound = 2 * model.config.vocab_size * 3  # 3 positions of 2 examples a chunk
    rows = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: rows.append(out.shape[1]))
    with torch.no_grad():
        chunked = chunked_token_loss(model, {"input_ids": ids}, targets, chunk_elements=bound)
    handle.remove()
    full_logits = model(input_ids=ids).logits[:, :-1]
    full = F.cross_entropy(full_logits.float().transpose(1, 2), targets, reduction="none", ignore_index=-100)
    assert chunked is not None and chunked.shape == (2, T - 1)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    # the model's one position and the check's, then the chunks
    assert rows[:2] == [1, 1] and max(rows[2:]) == 3 and sum(rows[2:]) == T - 1


def test_a_batch_within_one_chunk_runs_on_the_full_logits():
    model = llama(seed=0, attn="sdpa")
    ids = _ids(model.config.vocab_size)
    assert chunked_token_loss(model, {"input_ids": ids}, ids[:, 1:]) is None  # 2 x 40 x vocab << CHUNK_ELEMENTS


def test_fisher_is_the_same_with_the_head_on_chunks(monkeypatch):
    model = llama(seed=0, attn="sdpa")
    batches = [{"input_ids": _ids(model.config.vocab_size)}]
    full = fisher_importance(model, HeadMask.for_model(model), batches, task=CAUSAL_LM)
    monkeypatch.setattr(lm_head_chunks, "CHUNK_ELEMENTS", 2 * model.config.vocab_size * 4)
    calls = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: calls.append(out.shape[1]))
    chunked = fisher_importance(model, HeadMask.for_model(model), batches, task=CAUSAL_LM)
    handle.remove()
    assert max(calls) == 4  # the metric ran on chunks (recomputed in the backward pass: more calls)
    torch.testing.assert_close(chunked, full, rtol=1e-4, atol=1e-12)
    assert float(full.abs().sum()) > 0


def test_soft_capped_logits_fall_back_to_the_full_logits():
    config = MORE_FAMILIES["gemma2"][0]()
    assert config.final_logit_softcapping
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = _ids(config.vocab_size)
    assert chunked_token_loss(model, {"input_ids": ids}, ids[:, 1:], chunk_elements=8) is None
    with torch.no_grad():
        loss = CAUSAL_LM.model_loss(model, {"input_ids": ids})
        expected = CAUSAL_LM.loss(model(input_ids=ids).logits, {"input_ids": ids})
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_other_families_chunk_exactly(family):
    config = MORE_FAMILIES[family][0]()
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = _ids(config.vocab_size)
    with torch.no_grad():
        chunked = chunked_token_loss(model, {"input_ids": ids}, ids[:, 1:], chunk_elements=2 * config.vocab_size * 5)
        full = F.cross_entropy(model(input_ids=ids).logits[:, :-1].float().transpose(1, 2), ids[:, 1:],
                               reduction="none")
    assert chunked is not None
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
