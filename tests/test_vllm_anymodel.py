"""vLLM AnyModel checkpoints (deploy/vllm_anymodel.py), read back by the rules vLLM's anymodel.py
applies (PR #36512; vLLM itself cannot be installed or run here): per-layer config, weights'
shapes, and the logits of a model rebuilt from the folder alone the way AnyModel rebuilds it."""
import copy
import json

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from safetensors.torch import load_file

from headprune import prune_heads
from headprune.deploy.vllm_anymodel import (anymodel_config, anymodel_refusal, read_layer_configs,
                                            save_anymodel)
from headprune.heads.windows import KVLayout, KVWindows
from tests.helpers import UNEVEN, bpe_tokenizer, llama, tiny_llama


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def tiny_qwen2(prune=None, seed: int = 0):
    """A random Qwen2 (Q/K/V biases, untied head): 4 layers x 8 query / 4 KV heads of 8, pruned to `prune`."""
    config = tf.Qwen2Config(vocab_size=64, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                            num_hidden_layers=4, intermediate_size=96, max_position_embeddings=128,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return prune_heads(model, prune) if prune else model


def rebuilt_as_anymodel(folder) -> torch.nn.Module:
    """The model AnyModel would build from `folder`, with transformers' layers standing in for
    vLLM's: the base class from the global config, each layer with overrides rebuilt from a deep
    copy of the config with them applied (`read_layer_configs`), a no-op attention contributing
    nothing, and the weights loaded strictly (every tensor of the folder used, none missing)."""
    config_dict = json.loads((folder / "config.json").read_text())
    base = getattr(tf, config_dict["base_architecture"])
    config = base.config_class.from_dict({k: v for k, v in config_dict.items() if k != "architectures"})
    config._attn_implementation = "eager"
    model = base(config).eval()
    layer_class = type(model.model.layers[0])
    for i, layer in enumerate(read_layer_configs(config_dict)):
        per_layer = copy.deepcopy(config)
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            setattr(per_layer, key, layer[key])
        model.model.layers[i] = layer_class(per_layer, i)
        if not layer["attention"]:
            del model.model.layers[i].self_attn, model.model.layers[i].input_layernorm
            model.model.layers[i].self_attn = NoOpAttention()
            model.model.layers[i].input_layernorm = torch.nn.Identity()
    state = load_file(str(folder / "model.safetensors"))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    return model.eval()


class NoOpAttention(torch.nn.Module):
    """AnyModel's no-op attention: the layer adds no attention output (vLLM defers the residual add
    to the next norm; in transformers' layer the residual add of zeros is the same)."""

    def forward(self, hidden_states, **kwargs):
        return torch.zeros_like(hidden_states), None


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_config_holds_per_layer_heads_and_no_op_attention(tmp_path, tok, family):
    """UNEVEN: layer 1 attention-free (no_op, no weights), layer 2 one of four KV groups, layer 3
    groups 0 (one query head) and 1 (two): four query slots, one zero head padded in. Seen
    failing with the padding removed (layer 3's q_proj 3 heads wide) and with num_attention_heads
    left out of the extra fields (every layer built with 8 query heads)."""
    model = tiny_llama(tok, UNEVEN, tie_word_embeddings=True) if family == "llama" else tiny_qwen2(UNEVEN)
    config = anymodel_config(model)
    assert config["architectures"] == ["AnyModel"]
    assert config["base_architecture"] == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    assert config["head_dim"] == 8 and config["model_type"] == family
    layers = read_layer_configs(config)
    assert [(x["attention"], x["num_attention_heads"], x["num_key_value_heads"]) for x in layers] == \
        [(True, 8, 4), (False, 8, 4), (True, 2, 1), (True, 4, 2)]
    assert config["block_configs"][1]["attention"] == {"no_op": True}
    folder = save_anymodel(model, tmp_path / "anymodel", tokenizer=tok)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}."
        if not layer["attention"]:
            assert not [k for k in shapes if k.startswith((prefix + "self_attn.", prefix + "input_layernorm."))]
            continue
        d, q, kv = layer["head_dim"], layer["num_attention_heads"], layer["num_key_value_heads"]
        assert shapes[prefix + "self_attn.q_proj.weight"] == (q * d, 64)
        assert shapes[prefix + "self_attn.k_proj.weight"] == shapes[prefix + "self_attn.v_proj.weight"] == (kv * d, 64)
        assert shapes[prefix + "self_attn.o_proj.weight"] == (64, q * d)
        if family == "qwen2":
            assert shapes[prefix + "self_attn.q_proj.bias"] == (q * d,)
            assert shapes[prefix + "self_attn.k_proj.bias"] == (kv * d,)
        assert shapes[prefix + "mlp.up_proj.weight"][0] == layer["intermediate_size"]
    assert config["tie_word_embeddings"] == (family == "llama")
    assert ("lm_head.weight" in shapes) == (family == "qwen2")  # vLLM ties a tied head to the embedding
    assert (folder / "tokenizer.json").is_file()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_model_rebuilt_by_anymodels_rules_computes_the_pruned_models_logits(tmp_path, tok, family):
    """From the folder alone, the model AnyModel's rules build computes the pruned model's logits.
    Seen failing with the zero query head padded at the end of layer 3 instead of into its group,
    and with the no-op layer's input norm written under another name (loaded into nothing)."""
    model = tiny_llama(tok, UNEVEN, tie_word_embeddings=True) if family == "llama" else tiny_qwen2(UNEVEN)
    folder = save_anymodel(model, tmp_path / "anymodel")
    rebuilt = rebuilt_as_anymodel(folder)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)


def test_refusals_name_the_reason(tok):
    """Windowed KV units, a headless layer with a fitted bias, an all-attention-free layout, and a
    family outside AnyModel's registry are refused before anything is written."""
    model = llama(attn="sdpa")
    windows = KVWindows(KVLayout((("window", "full"), ("full", "full")), sink=1, window=4)).attach(model)
    assert "windowed KV units" in anymodel_refusal(model) and "AnyModel" in anymodel_refusal(model)
    with pytest.raises(ValueError, match="vLLM AnyModel export refused: the model has windowed KV units"):
        anymodel_config(model)
    windows.detach()
    KVWindows(KVLayout.uniform(model, "full", sink=1, window=4)).attach(model)
    assert anymodel_refusal(model) is None  # every unit full: nothing windowed
    biased = tiny_llama(tok, {1: list(range(8))}, attention_bias=True)
    assert anymodel_refusal(biased) is None  # a zero bias adds nothing
    with torch.no_grad():
        biased.model.layers[1].self_attn.o_proj.bias.fill_(0.5)
    assert "layer 1 keeps no heads but its output projection has a non-zero bias" in anymodel_refusal(biased)
    assert "every layer is attention-free" in anymodel_refusal(tiny_llama(tok, {i: list(range(8)) for i in range(4)}))
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=16, n_embd=16, n_head=2, n_layer=1, n_positions=8))
    assert "GPT2LMHeadModel" in anymodel_refusal(gpt2) and "allowed: LlamaForCausalLM" in anymodel_refusal(gpt2)


def test_export_cli_writes_the_folder_and_refuses_windows(tmp_path, tok, capsys):
    """`headprune-export <folder> --vllm-anymodel <dir>`: the checkpoint with the folder's tokenizer,
    a second export replaces its own earlier folder, a folder of something else is not replaced,
    and a windowed layout exits 2 with the reason, writing nothing."""
    from headprune import save_pruned
    from headprune.apps.export import main as export_main

    save_pruned(tiny_llama(tok, UNEVEN), tmp_path / "model", tokenizer=tok)
    args = [str(tmp_path / "model"), "--vllm-anymodel", str(tmp_path / "any")]
    assert export_main(args) == 0
    config = json.loads((tmp_path / "any" / "config.json").read_text())
    assert [b["attention"].get("num_key_value_heads") for b in config["block_configs"]] == [4, None, 1, 2]
    assert (tmp_path / "any" / "tokenizer.json").is_file()
    report = json.loads(capsys.readouterr().out)
    assert report["attention_free_layers"] == [1] and report["kv_heads"] == [4, 0, 1, 2]
    assert report["heads"] == [8, 0, 2, 4] and report["padded_heads"] == 1
    assert export_main(args) == 0  # its own earlier checkpoint is replaced

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "model"), "--vllm-anymodel", str(tmp_path / "other")])
    assert exit_.value.code == 2 and "not an AnyModel checkpoint" in capsys.readouterr().err

    windowed = llama(tok, attn="sdpa")
    KVWindows(KVLayout((("window", "full"), ("full", "full")), sink=1, window=4)).attach(windowed)
    save_pruned(windowed, tmp_path / "windowed", tokenizer=tok)
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "windowed"), "--vllm-anymodel", str(tmp_path / "any2")])
    assert exit_.value.code == 2 and "--vllm-anymodel" in (err := capsys.readouterr().err)
    assert "windowed KV units" in err and not (tmp_path / "any2").exists()
