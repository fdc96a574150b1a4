"""The block-by-block reconstructions (recovery=least_squares, refit) on models whose forward does
not call its blocks one after another on one hidden state: DeBERTa (its encoder unpacks each layer's
output) and the encoder-decoders (Whisper: two stacks) are refused before any work, naming the
recovery and the model type, in the Python API and in headprune-train (issue 56), instead of
`ValueError: too many values to unpack` after results.json was written."""
import pytest
import torch
import transformers as tf

from headprune import prune_to_budget
from headprune.recovery.least_squares import LeastSquares


def _deberta():
    config = tf.DebertaV2Config(vocab_size=100, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                intermediate_size=64, relative_attention=True, pos_att_type=["c2p", "p2c"])
    return tf.DebertaV2ForSequenceClassification(config).eval()


def _whisper():
    config = tf.WhisperConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                              max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2, decoder_start_token_id=1)
    return tf.WhisperForConditionalGeneration(config).eval()


def _never_read():
    raise AssertionError("the calibration data was read: the refusal came after work began")
    yield


@pytest.mark.parametrize("build, model_type, why", [
    (_deberta, "deberta-v2", "does not call its blocks one after another on one hidden state"),
    (_whisper, "whisper", "several attention stacks"),
])
def test_the_python_api_refuses_before_any_work(build, model_type, why):
    """Each refused for its own reason: DeBERTa by the one-example probe of its forward, Whisper for
    its two stacks (before any probe)."""
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"recovery=least_squares .*model_type='{model_type}'.*{why}.*allowed"):
        prune_to_budget(model, _never_read(), budget={"kind": "heads", "target": 0.5}, recovery="least_squares")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_model_that_runs_block_by_block_passes():
    from tests.helpers import tiny

    LeastSquares().check_model(tiny("llama"))
    LeastSquares().check_model(tiny("bert"))


def test_headprune_train_refuses_deberta_least_squares_before_writing(tmp_path, data_dir):
    from headprune.apps.train import run
    from tests.helpers import compose_train

    config = tf.DebertaV2Config(vocab_size=30522, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                intermediate_size=64, relative_attention=True, pos_att_type=["c2p", "p2c"])
    config.save_pretrained(tmp_path / "deberta")
    from headprune.models import load_tokenizer

    load_tokenizer("minilm").save_pretrained(tmp_path / "deberta")
    out = tmp_path / "run"
    cfg = compose_train(out, data_dir, "model=tiny_bert", f"model.pretrained={tmp_path / 'deberta'}",
                        "model.attn_implementation=eager", "~model.config_overrides", "logger=none",
                        "schedule=one_shot", "schedule.baseline_epochs=0", "schedule.epochs_per_round=0",
                        "schedule.target_sparsity=0.5", "recovery=least_squares", "data.max_train_samples=16",
                        "data.score_samples=8", "data.max_validation_samples=8", "diagnostics.enabled=false")
    with pytest.raises(ValueError, match=r"recovery=least_squares .*model_type='deberta-v2'"):
        run(cfg)
    assert not (out / "results.json").exists()
