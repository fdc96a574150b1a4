"""GGUF export (deploy/gguf_export.py) and the vLLM DeciLM config (deploy/vllm_deci.py), read back
with the `gguf` package's reader; llama.cpp running the files: test_llamacpp.py."""
import json

import gguf
import numpy as np
import pytest
import torch

from headprune import prune_heads, save_gguf
from headprune.deploy.gguf_export import gguf_layout, gguf_refusal, permute_rotary
from headprune.deploy.vllm_deci import deci_config, deci_refusal, read_block_configs, save_deci
from tests.helpers import UNEVEN, bpe_tokenizer, llama, tiny, tiny_bert, tiny_llama


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer()


def fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items()}, {t.name: t for t in reader.tensors}


def rope_half(x, pos, theta=10000.0):
    """transformers' rotary: dimension i rotates with i + d/2. x: (T, d)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None] * inv[None]  # (T, d/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rot = torch.cat([-x[:, d // 2:], x[:, : d // 2]], -1)
    return x * cos + rot * sin


def rope_pairs(x, pos, theta=10000.0):
    """llama.cpp's normal rotary: dimension 2i rotates with 2i + 1. x: (T, d)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None] * inv[None]
    a, b = x[:, 0::2], x[:, 1::2]
    out = torch.empty_like(x)
    out[:, 0::2] = a * ang.cos() - b * ang.sin()
    out[:, 1::2] = a * ang.sin() + b * ang.cos()
    return out


def test_permuted_rows_give_llamacpp_rotary_the_same_scores():
    """q.k after transformers' rotary on the original rows == after llama.cpp's on the permuted rows."""
    g = torch.Generator().manual_seed(0)
    heads, d, hidden = 3, 8, 16
    wq, wk = torch.randn(heads * d, hidden, generator=g, dtype=torch.float64), torch.randn(heads * d, hidden,
                                                                                          generator=g, dtype=torch.float64)
    x, pos = torch.randn(5, hidden, generator=g, dtype=torch.float64), torch.arange(5, dtype=torch.float64)
    pq, pk = permute_rotary(wq, heads), permute_rotary(wk, heads)
    for h in range(heads):
        rows = slice(h * d, (h + 1) * d)
        hf = rope_half(x @ wq[rows].T, pos) @ rope_half(x @ wk[rows].T, pos).T
        cpp = rope_pairs(x @ pq[rows].T, pos) @ rope_pairs(x @ pk[rows].T, pos).T
        torch.testing.assert_close(cpp, hf)
        assert not torch.allclose(rope_pairs(x @ wq[rows].T, pos) @ rope_pairs(x @ wk[rows].T, pos).T, hf)


def test_layouts_uniform_llama_uneven_deci(tok):
    dense = gguf_layout(tiny_llama(tok))
    assert (dense.arch, dense.heads, dense.kv_heads, dense.padded_heads) == ("llama", [8] * 4, [4] * 4, 0)
    uniform = gguf_layout(tiny_llama(tok, {i: [6, 7] for i in range(4)}))
    assert (uniform.arch, uniform.heads, uniform.kv_heads) == ("llama", [6] * 4, [3] * 4)
    uneven = gguf_layout(tiny_llama(tok, UNEVEN))
    # layer 3 keeps heads 0, 2, 3: groups 0 (one head) and 1 (two): one zero query head padded in
    assert (uneven.arch, uneven.heads, uneven.kv_heads, uneven.padded_heads) == ("deci", [8, 0, 2, 4], [4, 0, 1, 2], 1)
    assert uneven.kv_bytes_per_token() == [2 * kv * 8 * 2 for kv in (4, 0, 1, 2)]


@pytest.mark.parametrize("weights", ["f32", "f16", "q8_0"])
def test_deci_file_holds_per_layer_shapes(tmp_path, tok, weights):
    model = tiny_llama(tok, UNEVEN)
    out = save_gguf(model, tmp_path / "m.gguf", tokenizer=tok, weights=weights)
    meta, tensors = fields(out.path)
    assert meta["general.architecture"] == "deci"
    assert meta["deci.attention.head_count"] == [8, 0, 2, 4]
    assert meta["deci.attention.head_count_kv"] == [4, 0, 1, 2]
    assert meta["deci.feed_forward_length"] == [128] * 4
    assert (meta["deci.attention.key_length"], meta["deci.attention.value_length"],
            meta["deci.rope.dimension_count"]) == (8, 8, 8)
    assert not [n for n in tensors if n.startswith("blk.1.attn")]  # attention-free: no attention tensors
    # numpy shape (rows, cols) = transformers' (out, in); llama.cpp's ne is reversed
    assert list(tensors["blk.2.attn_q.weight"].shape) == [64, 16] and list(tensors["blk.2.attn_k.weight"].shape) == [64, 8]
    assert list(tensors["blk.3.attn_q.weight"].shape) == [64, 32] and list(tensors["blk.3.attn_output.weight"].shape) == [32, 64]
    kinds = {t.tensor_type for n, t in tensors.items() if not n.endswith("norm.weight")}
    want = {"f32": {gguf.GGMLQuantizationType.F32}, "f16": {gguf.GGMLQuantizationType.F16},
            "q8_0": {gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16}}[weights]
    assert kinds == want
    if weights == "q8_0":  # rows of 8 or 16 values are no whole 32-value block: F16
        assert out.f16_fallback == ["blk.2.attn_output.weight"]
    assert "output.weight" in tensors  # not tied
    assert meta["tokenizer.ggml.tokens"][:3] == [tok.convert_ids_to_tokens(i) for i in range(3)]
    assert meta["tokenizer.chat_template"] == tok.chat_template


def test_padded_query_head_is_zero_and_rows_are_permuted(tmp_path, tok):
    model = tiny_llama(tok, UNEVEN)
    out = save_gguf(model, tmp_path / "m.gguf", tokenizer=tok, weights="f32")
    _, tensors = fields(out.path)
    attn = model.model.layers[3].self_attn
    q = np.asarray(tensors["blk.3.attn_q.weight"].data)  # (4 heads * 8, 64): slots 0 (head 0), 1 (pad), 2, 3
    o = np.asarray(tensors["blk.3.attn_output.weight"].data)  # (64, 4 * 8)
    assert not q[8:16].any() and not o[:, 8:16].any()
    assert np.array_equal(q[16:32], permute_rotary(attn.q_proj.weight.detach()[8:24], 2).numpy())
    assert np.array_equal(o[:, 16:32], attn.o_proj.weight.detach()[:, 8:24].numpy())
    k = np.asarray(tensors["blk.3.attn_k.weight"].data)
    assert np.array_equal(k, permute_rotary(attn.k_proj.weight.detach(), 2).numpy())


def test_uniform_file_is_llama_with_scalars_and_copies_a_source_vocabulary(tmp_path, tok):
    source = save_gguf(tiny_llama(tok), tmp_path / "dense.gguf", tokenizer=tok, weights="f16")
    pruned = tiny_llama(tok, {i: [0, 1] for i in range(4)}, tie_word_embeddings=True)
    out = save_gguf(pruned, tmp_path / "kv.gguf", source_gguf=source.path, weights="f16")
    meta, tensors = fields(out.path)
    src, _ = fields(source.path)
    assert meta["general.architecture"] == "llama"
    assert (meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]) == (6, 3)
    assert meta["llama.attention.key_length"] == 8
    assert {k: v for k, v in meta.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in src.items() if k.startswith("tokenizer.")}
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd


def test_a_headless_layers_bias_is_folded_into_the_ffn_before_it(tmp_path, tok):
    """llama.cpp's attention-free deci layer adds nothing, so a bias a recovery fitted there goes
    into the previous layer's FFN down-projection bias (only a residual sum lies between them)."""
    biased = tiny_llama(tok, attention_bias=True)
    prune_heads(biased, {2: list(range(8))})
    with torch.no_grad():
        biased.model.layers[2].self_attn.o_proj.bias.fill_(0.5)
    assert gguf_refusal(biased) is None
    _, tensors = fields(save_gguf(biased, tmp_path / "m.gguf", tokenizer=tok, weights="f32").path)
    assert np.array_equal(np.asarray(tensors["blk.1.ffn_down.bias"].data), np.full(64, 0.5, dtype=np.float32))
    assert not any(name.startswith("blk.2.attn") for name in tensors) and "blk.0.ffn_down.bias" not in tensors


def test_refusals_say_why_before_writing(tmp_path, tok):
    target = tmp_path / "x.gguf"
    cases = {
        "an encoder": tiny_bert(),
        "model_type='gpt2'": tiny("gpt2"),
        "layer 0 keeps no heads": tiny_llama(tok, {0: list(range(8))}),
        "rope_type='llama3'": tiny_llama(tok, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                                               "factor": 8.0, "low_freq_factor": 1.0,
                                                               "high_freq_factor": 4.0,
                                                               "original_max_position_embeddings": 64}),
        "sliding_window=4": tiny("mistral"),
    }
    for reason, model in cases.items():
        assert reason in (gguf_refusal(model) or ""), (reason, gguf_refusal(model))
        with pytest.raises(ValueError, match="GGUF export refused"):
            save_gguf(model, target, tokenizer=tok)
    with pytest.raises(ValueError, match="weights='q4'"):
        save_gguf(tiny_llama(tok), target, tokenizer=tok, weights="q4")
    with pytest.raises(ValueError, match="needs the vocabulary"):
        save_gguf(tiny_llama(tok), target)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left
    target.write_bytes(b"old")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_gguf(tiny_llama(tok), target, tokenizer=tok)
    assert target.read_bytes() == b"old"


def test_a_failed_write_leaves_the_old_file(tmp_path, tok, monkeypatch):
    target = tmp_path / "x.gguf"
    target.write_bytes(b"old")

    def boom(self):
        raise OSError("disk full")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_gguf(tiny_llama(tok), target, tokenizer=tok, overwrite=True)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["x.gguf"]


# -- vLLM DeciLMForCausalLM ---------------------------------------------------------------------------
def test_block_configs_read_back_as_vllm_reads_them(tmp_path, tok):
    model = tiny_llama(tok, {1: list(range(8)), 3: list(range(8))}, intermediate_size=256)
    config = deci_config(model)
    assert config["architectures"] == ["DeciLMForCausalLM"] and config["model_type"] == "nemotron-nas"
    assert read_block_configs(config) == [(8, 4, 256), (0, 0, 256), (8, 4, 256), (0, 0, 256)]
    folder = save_deci(model, tmp_path / "deci")
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.0.input_layernorm.weight" in keys
    assert not [k for k in keys if k.startswith(("model.layers.1.self_attn", "model.layers.1.input_layernorm"))]
    assert "model.layers.1.mlp.up_proj.weight" in keys


def test_block_configs_refuse_what_deci_cannot_express(tok):
    assert "layer 2 keeps 6 of 8 query heads" in deci_refusal(tiny_llama(tok, {2: [0, 1]}, intermediate_size=256))
    assert "intermediate_size=128" in deci_refusal(tiny_llama(tok, {1: list(range(8))}))
    with pytest.raises(ValueError, match="vLLM DeciLM export refused"):
        deci_config(tiny_llama(tok, {2: [0, 1]}))
    biased = tiny_llama(tok, {1: list(range(8))}, intermediate_size=256, attention_bias=True)
    assert deci_refusal(biased) is None  # a zero bias adds nothing
    with torch.no_grad():
        biased.model.layers[1].self_attn.o_proj.bias.fill_(0.5)
    assert "layer 1 keeps no heads but its output projection has a non-zero bias" in deci_refusal(biased)
    assert deci_refusal(llama(vocab_size=10, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                              num_hidden_layers=1, intermediate_size=256)) is None


def test_save_deci_keeps_the_models_dtype(tmp_path, tok):
    """save_deci wrote float32 weights whatever the model held (a bfloat16 model doubled in size);
    it writes the model's own dtype and says it in config.json."""
    from safetensors import safe_open

    model = tiny_llama(tok, {1: list(range(8))}, intermediate_size=256).to(torch.bfloat16)
    folder = save_deci(model, tmp_path / "deci")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_cli_writes_a_vllm_deci_checkpoint_beside_the_gguf(tmp_path, tok, capsys):
    """`headprune-export <folder> --vllm-deci <dir>`: the DeciLM checkpoint (with the folder's
    tokenizer, which vLLM reads from the model folder) beside a GGUF of the same model; a second
    export replaces it; a layout DeciLM cannot express exits 2 with the reason, writing nothing."""
    from headprune import save_pruned
    from headprune.apps.export import main as export_main

    save_pruned(tiny_llama(tok, {1: list(range(8)), 3: list(range(8))}, intermediate_size=256), tmp_path / "model",
                tokenizer=tok)
    args = [str(tmp_path / "model"), "--vllm-deci", str(tmp_path / "deci"), "--gguf", str(tmp_path / "m.gguf")]
    assert export_main(args) == 0
    config = json.loads((tmp_path / "deci" / "config.json").read_text())
    assert read_block_configs(config) == [(8, 4, 256), (0, 0, 256), (8, 4, 256), (0, 0, 256)]
    assert (tmp_path / "deci" / "tokenizer.json").is_file() and (tmp_path / "m.gguf").is_file()
    report = capsys.readouterr().out
    assert f'"vllm_deci": "{tmp_path / "deci"}"' in report and '"attention_free_layers": [\n    1,\n    3\n  ]' in report
    assert export_main(args) == 0  # its own earlier checkpoint is replaced

    save_pruned(tiny_llama(tok, {2: [0, 1]}, intermediate_size=256), tmp_path / "uneven", tokenizer=tok)
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "uneven"), "--vllm-deci", str(tmp_path / "deci2")])
    assert exit_.value.code == 2 and "--vllm-deci" in (err := capsys.readouterr().err)
    assert "layer 2 keeps 6 of 8 query heads" in err and not (tmp_path / "deci2").exists()


# -- headprune-export --gguf --------------------------------------------------------------------------
def test_export_cli_writes_a_deci_gguf_from_a_save_pruned_folder(tmp_path, tok, capsys):
    from headprune import save_pruned
    from headprune.apps.export import main as export_main

    save_pruned(tiny_llama(tok, UNEVEN), tmp_path / "model", tokenizer=tok)
    assert export_main([str(tmp_path / "model"), "--gguf", str(tmp_path / "m.gguf"), "--gguf-weights", "f32"]) == 0
    meta, _ = fields(tmp_path / "m.gguf")
    assert meta["deci.attention.head_count_kv"] == [4, 0, 1, 2]
    assert '"vocabulary_from": "tokenizer"' in capsys.readouterr().out


def test_export_cli_refuses_before_writing(tmp_path, tok, capsys):
    from headprune import save_pruned
    from headprune.apps.export import main as export_main

    save_pruned(tiny_llama(tok, {0: list(range(8))}), tmp_path / "model", tokenizer=tok)
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "model"), "--gguf", str(tmp_path / "m.gguf")])
    assert exit_.value.code == 2 and "layer 0 keeps no heads" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()


def test_ci_runs_the_readme_test_command_with_llamacpp():
    """.ci/run runs the README's test command as written, and that command installs llama.cpp
    (portable build: a native one crashed on quantized weights)."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    readme, ci = (repo / "README.md").read_text(), (repo / ".ci" / "run").read_text()
    command = next(c for c in re.findall(r"```bash\n(.*?)\n```", readme, re.S) if ".venv/bin/pytest" in c)
    assert command in ci.splitlines()
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF"' in command and '".[dev,llamacpp]"' in command
    assert 'llamacpp = ["llama-cpp-python' in (repo / "pyproject.toml").read_text()


def test_llamacpp_experiment_tables_are_what_its_raw_files_give():
    """experiments/llm_kv/decode: the llama.cpp tables in its README are tables.py's rendering of the
    committed agreement.json and bench.json, and bench.md is the bench report of bench.json."""
    import json

    from headprune.bench.report import markdown
    from tests.helpers import EXPERIMENTS, experiment_script

    folder = EXPERIMENTS / "llm_kv" / "decode" / "llamacpp"
    tables = experiment_script("llm_kv/decode/llamacpp/tables")
    readme = (folder.parent / "README.md").read_text()
    bench = json.loads((folder / "bench.json").read_text())
    assert tables.agreement_table(json.loads((folder / "agreement.json").read_text())) in readme
    assert tables.decode_table(bench) in readme and tables.shares(bench) in readme
    assert markdown(bench) == (folder / "bench.md").read_text()


def test_export_cli_refuses_a_tokenizer_without_merges_with_exit_2(tmp_path, capsys):
    """A byte-level tokenizer without BPE merges cannot be written as llama.cpp's gpt2 vocabulary:
    exit 2 with the reason, as the help promises for what a format cannot express, and no file
    (issue 56)."""
    from headprune import save_pruned
    from headprune.apps.export import main as export_main
    from tests.helpers import byte_tokenizer

    no_merges = byte_tokenizer()
    save_pruned(tiny_llama(no_merges, {1: [0, 1]}), tmp_path / "model", tokenizer=no_merges)
    with pytest.raises(SystemExit) as exit_:
        export_main([str(tmp_path / "model"), "--gguf", str(tmp_path / "m.gguf")])
    assert exit_.value.code == 2 and "has no BPE merges" in capsys.readouterr().err
    assert not (tmp_path / "m.gguf").exists()
