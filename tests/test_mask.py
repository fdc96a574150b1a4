import pytest
import torch

from headprune.heads.adapters import get_adapter
from headprune.heads.mask import HeadMask
from tests.helpers import tiny_batch, tiny_bert


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_masking_equals_zeroing_output_projection_columns(attn, tokenizer):
    model = tiny_bert(attn)
    batch = tiny_batch(tokenizer)
    to_mask = [(0, 1), (1, 0), (1, 3), (2, 2)]

    mask = HeadMask.for_model(model)
    mask.prune(to_mask)
    with torch.no_grad():
        masked = model(**_inputs(batch)).logits
    mask.detach()

    adapter = get_adapter(model)
    head_dim = adapter.head_dim(model.config)
    with torch.no_grad():
        for layer, head in to_mask:
            o = adapter.out_proj(adapter.blocks(model)[layer])
            o.weight[:, head * head_dim:(head + 1) * head_dim] = 0.0
        zeroed = model(**_inputs(batch)).logits
    torch.testing.assert_close(masked, zeroed, atol=1e-6, rtol=0)


def test_unmasked_model_is_unchanged_and_masking_changes_output(tokenizer):
    model = tiny_bert()
    batch = tiny_batch(tokenizer)
    with torch.no_grad():
        plain = model(**_inputs(batch)).logits
    mask = HeadMask.for_model(model)
    with torch.no_grad():
        assert torch.equal(model(**_inputs(batch)).logits, plain)
        mask.prune([(0, 0), (1, 1)])
        assert not torch.allclose(model(**_inputs(batch)).logits, plain)
    mask.detach()
    with torch.no_grad():
        assert torch.equal(model(**_inputs(batch)).logits, plain)


def test_mask_bookkeeping():
    mask = HeadMask(3, 4)
    mask.prune([(0, 1), (2, 3), (2, 0)])
    assert mask.heads_per_layer() == [3, 4, 2]
    assert mask.pruned() == [[0, 1], [2, 0], [2, 3]]
    assert mask.sparsity() == pytest.approx(3 / 12)
    with mask.override(torch.zeros(3, 4)):
        assert mask.sparsity() == 1.0
    assert mask.sparsity() == pytest.approx(3 / 12)
    assert "mask" in mask.state_dict()


def test_mask_shape_must_match_model():
    model = tiny_bert()
    with pytest.raises(ValueError, match="does not match"):
        HeadMask(2, 4).attach(model)


def test_unsupported_architecture_lists_supported():
    class Fake(torch.nn.Module):
        class config:
            model_type = "mamba"

    with pytest.raises(NotImplementedError, match="bert.*gpt2.*llama"):
        get_adapter(Fake())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_masking_equals_zeroing_output_projection_columns_in_decoders(family, attn):
    """GPT-2 (Conv1D c_proj, weight (in, out): a head owns D rows) and Llama with grouped-query
    attention (4 query heads sharing 2 KV heads): masking a head = zeroing its O inputs."""
    from tests.helpers import inputs, tiny

    model = tiny(family, attn)
    batch = inputs()
    to_mask = [(0, 1), (1, 0), (1, 3), (2, 2)]
    mask = HeadMask.for_model(model)
    mask.prune(to_mask)
    with torch.no_grad():
        masked = model(**batch).logits
    mask.detach()
    adapter = get_adapter(model)
    d = adapter.head_dim(model.config)
    with torch.no_grad():
        unmasked = model(**batch).logits
        for layer, head in to_mask:
            o = adapter.out_proj(adapter.blocks(model)[layer])
            if family == "gpt2":  # Conv1D: weight (in, out), head h owns input rows h*D..(h+1)*D
                o.weight[head * d:(head + 1) * d, :] = 0.0
            else:  # Linear: weight (out, in)
                o.weight[:, head * d:(head + 1) * d] = 0.0
        zeroed = model(**batch).logits
    torch.testing.assert_close(masked, zeroed, atol=1e-5, rtol=0)
    assert not torch.allclose(masked, unmasked, atol=1e-3)
