"""Perplexity in fixed windows: the windows (count, same tokens every call, held-out tail, BOS
on/off), the number against a direct per-window computation, and the real SmolLM2 on Tiny
Shakespeare (40.8 on its first 1,024 tokens as one window, no BOS)."""
import math
from pathlib import Path

import pytest
import torch

from headprune.evaluation import Windows, perplexity, text_windows
from headprune.models.byte_tokenizer import ByteTokenizer
from tests.helpers import smollm2, tiny_byte_llama

TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(40))  # 2,170 bytes


def direct_ppl(model, windows) -> tuple[float, int]:
    """exp(mean token loss) over every window, one window at a time, from log-softmax."""
    losses = []
    for row in windows.ids:  # (seq,)
        ids = torch.cat([torch.tensor([windows.bos_token_id]), row]) if windows.bos else row
        with torch.no_grad():
            logp = model(input_ids=ids[None]).logits[0].log_softmax(-1)  # (T, V)
        losses.append(-logp[:-1].gather(1, ids[1:, None])[:, 0])  # (T-1,)
    losses = torch.cat(losses)
    return math.exp(losses.mean().item()), losses.numel()


def test_windows_are_the_first_tokens_cut_in_seq_blocks_the_same_every_call():
    tok = ByteTokenizer()
    w = text_windows(tok, TEXT, seq=16, max_tokens=100)
    assert w.ids.shape == (6, 16) and not w.bos  # 100 // 16 windows, the tail of 4 dropped
    assert w.ids.flatten().tolist() == list(TEXT.encode())[:96]
    assert torch.equal(text_windows(tok, TEXT, seq=16, max_tokens=100).ids, w.ids)
    everything = text_windows(tok, TEXT, seq=16)
    assert everything.ids.shape == (len(TEXT.encode()) // 16, 16)


def test_validation_share_takes_the_held_out_tail():
    tok = ByteTokenizer()
    data = list(TEXT.encode())
    cut = round(0.9 * len(data))
    w = text_windows(tok, TEXT, seq=8, max_tokens=64, validation_share=0.1)
    assert w.ids.flatten().tolist() == data[cut:cut + 64]


def test_bos_is_prepended_to_every_window_and_scores_every_token():
    tok = ByteTokenizer()
    on, off = text_windows(tok, TEXT, seq=16, max_tokens=64, bos=True), text_windows(tok, TEXT, seq=16, max_tokens=64)
    assert torch.equal(on.ids, off.ids)  # the same text tokens either way
    assert on.inputs().shape == (4, 17) and (on.inputs()[:, 0] == tok.bos_token_id).all()
    assert torch.equal(off.inputs(), off.ids)
    model = tiny_byte_llama()
    r_on, r_off = perplexity(model, on), perplexity(model, off)
    assert (r_on["bos"], r_on["targets"], r_on["tokens"]) == (True, 64, 64)
    assert (r_off["bos"], r_off["targets"], r_off["tokens"]) == (False, 60, 64)
    assert r_on["ppl"] != r_off["ppl"]


@pytest.mark.parametrize("bos", [False, True])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_ppl_is_exp_of_the_mean_token_loss(bos, batch_size):
    model = tiny_byte_llama()
    windows = text_windows(ByteTokenizer(), TEXT, seq=12, max_tokens=60, bos=bos)  # 5 windows: a short last batch
    result = perplexity(model, windows, batch_size=batch_size)
    want, targets = direct_ppl(model, windows)
    assert set(result) == {"seq", "windows", "tokens", "targets", "bos", "loss", "ppl"}
    assert (result["seq"], result["windows"], result["tokens"], result["targets"]) == (12, 5, 60, targets)
    assert result["ppl"] == pytest.approx(want, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(result["loss"]))


def test_training_flag_is_restored():
    model = tiny_byte_llama().train()
    perplexity(model, text_windows(ByteTokenizer(), TEXT, seq=8, max_tokens=16))
    assert model.training


def test_bad_settings_name_the_field():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="less than one window of seq=4096"):
        text_windows(tok, TEXT, seq=4096)
    with pytest.raises(ValueError, match="max_tokens=8 must be"):
        text_windows(tok, TEXT, seq=16, max_tokens=8)
    with pytest.raises(ValueError, match="bos=True but the tokenizer has no bos_token_id"):
        text_windows(type("NoBos", (), {"bos_token_id": None, "encode": tok.encode})(), TEXT, seq=16, bos=True)
    with pytest.raises(ValueError, match="batch_size=0"):
        perplexity(tiny_byte_llama(), text_windows(tok, TEXT, seq=8, max_tokens=16), batch_size=0)


@pytest.mark.real_model
def test_smollm2_perplexity_on_the_first_1024_tokens_of_tiny_shakespeare(data_dir: Path):
    model, tokenizer = smollm2()
    text = (data_dir / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    result = perplexity(model, text_windows(tokenizer, text, seq=1024, max_tokens=1024, bos=False))
    assert (result["windows"], result["targets"]) == (1, 1023)
    assert result["ppl"] == pytest.approx(40.8, abs=0.5)  # issue 24's figure
    short = perplexity(model, text_windows(tokenizer, text, seq=128, max_tokens=1024, bos=True))
    assert math.isfinite(short["ppl"]) and short["ppl"] > result["ppl"]  # less context per token


def batched_sum_ppl(model, windows, batch_size) -> float:
    """The `evaluation` perplexity as it was computed before `val` and `evaluation` shared one
    implementation (the committed llm_kv numbers): summed float cross-entropy per batch of windows."""
    total, count = 0.0, 0
    for batch in windows.inputs().split(batch_size):  # (B, T)
        with torch.no_grad():
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1]  # (B, T-1, V)
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(),
                                                   reduction="sum").item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


@pytest.mark.parametrize("bos", [False, True])
def test_evaluation_numbers_are_bit_identical_to_the_earlier_implementation(bos):
    model = tiny_byte_llama()
    windows = text_windows(ByteTokenizer(), TEXT, seq=48, max_tokens=480, bos=bos)  # 10 windows, batches of 4
    assert perplexity(model, windows, batch_size=4)["ppl"] == batched_sum_ppl(model, windows, 4)


def test_val_is_the_same_implementation_on_bos_free_windows_of_the_held_out_part(data_dir):
    """`val` (CausalLM.evaluate over the data module's validation blocks) equals `perplexity` over
    `Windows.cut` of the held-out tokens at block_size without BOS, and the data module's
    val_windows() says so in the keys of a perplexity record."""
    from headprune.data.language_model import TextLMDataModule, held_out_start
    from headprune.tasks import CAUSAL_LM

    tok = ByteTokenizer()
    dm = TextLMDataModule(tok, file="tinyshakespeare/input.txt", data_dir=str(data_dir), block_size=32,
                          score_samples=4, max_train_samples=8, max_validation_samples=6, eval_batch_size=4)
    dm.setup("fit")
    text = (data_dir / "tinyshakespeare" / "input.txt").read_bytes()
    assert dm.held_out_ids.tolist() == list(text[held_out_start(len(text), 0.1):])
    model = tiny_byte_llama()
    val = CAUSAL_LM.evaluate(model, dm.val_dataloader())
    record = perplexity(model, Windows.cut(dm.held_out_ids, 32, max_tokens=6 * 32), batch_size=4)
    assert val == {"loss": record["loss"], "ppl": record["ppl"]}
    assert dm.val_windows() == {k: record[k] for k in ("seq", "windows", "tokens", "targets", "bos")}
