"""heads/verify.py: `prune_heads` verifies its own result (issue 56, item 11). A deliberately broken
adapter (GPT-OSS without its per-head attention sinks declared, so `sinks` keeps the layer's old
head count) is caught by the one tiny forward, naming the module and the parameter left unsliced,
in the Python API and in a run's export, before anything is saved; a surgery that slices the wrong
entries (no exception, other numbers) is caught as a mismatch naming the attention module; the
check is switched off only by the explicit flags."""
import dataclasses

import pytest
import torch

from headprune import HeadMask, fold, prune_heads
from headprune.heads import adapters as adapters_module
from headprune.heads import surgery
from headprune.heads.verify import SurgeryError, probe_inputs, set_verify
from tests.helpers import PRUNE, tiny

PRUNED_LAYER_1 = {1: [2, 3]}  # a whole KV group: the kernel runs 2 query slots, not 4


@pytest.fixture
def sinks_undeclared(monkeypatch):
    """GPT-OSS's adapter without `head_params=("sinks",)`: its per-head sink logits are left unsliced."""
    broken = dataclasses.replace(adapters_module.ADAPTERS["gpt_oss"], head_params=())
    monkeypatch.setitem(adapters_module.ADAPTERS, "gpt_oss", broken)


def test_an_unsliced_per_head_parameter_is_named_by_prune_heads(sinks_undeclared):
    model = tiny("gpt_oss", "eager")
    with pytest.raises(SurgeryError) as raised:
        prune_heads(model, PRUNED_LAYER_1)
    message = str(raised.value)
    assert "model.layers.1.self_attn" in message
    assert "model.layers.1.self_attn.sinks [4]" in message and "left unsliced" in message
    assert "verify=False" in message


def test_fold_does_not_return_a_model_it_could_not_prune_right(sinks_undeclared, tmp_path):
    """The export path (`fold`, what every run's export calls) raises before `save_pruned` could run."""
    model = tiny("gpt_oss", "eager")
    mask = HeadMask.for_model(model)
    mask.prune([(1, 2), (1, 3)])
    with pytest.raises(SurgeryError, match=r"sinks"):
        fold(model, mask)


def test_wrongly_sliced_entries_are_a_mismatch_naming_the_module(monkeypatch):
    """No exception, other numbers: the per-head sinks kept for the wrong heads (reversed)."""
    keep = surgery._keep_head_params

    def reversed_heads(model, adapter, core, before, after, sliced):
        keep(model, adapter, core, before, after, sliced)
        core.sinks = torch.nn.Parameter(core.sinks.detach().flip(0) + 1.0)

    monkeypatch.setattr(surgery, "_keep_head_params", reversed_heads)
    model = tiny("gpt_oss", "eager")
    with pytest.raises(SurgeryError, match=r"does not compute what the masked model computes .*max \|pruned - masked\|"
                                           r".*first differing attention module: model\.layers\.1\.self_attn"):
        prune_heads(model, PRUNED_LAYER_1)


def test_the_check_is_switched_off_only_explicitly(sinks_undeclared):
    prune_heads(tiny("gpt_oss", "eager"), PRUNED_LAYER_1, verify=False)
    prune_heads(set_verify(tiny("gpt_oss", "eager"), False), PRUNED_LAYER_1)  # a run's pruning.verify_surgery=false
    model = tiny("gpt_oss", "eager")
    mask = HeadMask.for_model(model)
    mask.prune([(1, 2), (1, 3)])
    fold(model, mask, verify=False)


@pytest.mark.parametrize("family", ["llama", "bert", "gpt2", "qwen3", "vit", "whisper"])
def test_a_correct_surgery_passes_its_check_and_leaves_the_model_as_it_was(family, caplog):
    """Text, image and audio models each get a probe input; a right surgery passes; dropout modes and
    the RNG stream are as before (an exact resume depends on the RNG)."""
    import transformers as tf

    if family == "whisper":
        config = tf.WhisperConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                                  max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  decoder_start_token_id=1)
        model = tf.WhisperForConditionalGeneration(config)
        request = {"encoder": {0: [1]}, "decoder": {1: [0, 2]}}
    elif family == "vit":
        config = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              image_size=16, patch_size=8, num_labels=2)
        model = tf.ViTForImageClassification(config)
        request = {0: [1], 1: [0, 3]}
    else:
        model = tiny(family)
        request = PRUNE
    assert probe_inputs(model) is not None
    model.train()
    state = torch.random.get_rng_state()
    prune_heads(model, request)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(torch.random.get_rng_state(), state)
    assert "could not verify" not in caplog.text  # the probe ran


def test_a_run_switches_the_check_off_only_by_its_setting(tmp_path, data_dir):
    """`pruning.verify_surgery` (default true) is the run's one switch; assembly sets it on the model, so
    every prune_heads of the run (each round's removal, the export's fold) follows it."""
    from headprune.runs import RunSpec
    from headprune.heads.verify import wanted
    from tests.helpers import compose_train

    assert RunSpec.from_config(compose_train(tmp_path, data_dir, "model=tiny_bert")).pruning.verify_surgery is True
    spec = RunSpec.from_config(compose_train(tmp_path, data_dir, "model=tiny_bert", "pruning.verify_surgery=false"))
    assert spec.pruning.verify_surgery is False
    model = tiny("bert")
    assert wanted(model, None) and not wanted(set_verify(model, spec.pruning.verify_surgery), None)
    assert wanted(model, True)  # an explicit verify=True still verifies
