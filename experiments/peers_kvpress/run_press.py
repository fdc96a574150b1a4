"""One kvpress press (or dense) at one kept share of the KV bytes over a RULER samples file: greedy
answers, the KV bytes the press claims and holds, and the process's peak resident memory.

Runs in kvpress's own venv (setup.sh; kvpress 0.5.5 pins transformers < 5.3) or, for `--press dense`
only, in headprune's (the dense check: the same model folder, samples and loop under transformers 5.x).

The protocol is kvpress's own RULER one (its pipeline's `_forward`, written out here so the prompt is
the plain-text one lm-eval gives a base model, without the chat template the pipeline would apply):
each sample's prompt (`context`: the input, a space, the answer prefix) is split after the input's
last newline; the part before (the haystack, ~97% of the tokens) is prefilled inside the press's
context manager (compressed, query-agnostic), the rest (the question and the answer prefix) is fed
uncompressed, then up to `max_gen_toks` greedy tokens (stopping at EOS). Token ids: each part
tokenized without special tokens, as lm-eval's HF model does for this tokenizer.

Per sample the raw file holds the prediction, the token counts, the press's compression_ratio
after prefill (kvpress: the share of the context's KV entries it removed), the bytes the cache's
key/value tensors hold after prefill (`held_bytes`: for head-wise presses, AdaKV / KVzip /
DuoAttention, the cache keeps every entry and the removed ones are only masked at attention time,
kvpress/attention_patch.py), the entries masked (`masked_entries`), the greedy first answer token's
top-5 logits (the dense check), and seconds. Per run: ru_maxrss (the process's peak resident set,
KiB: Linux getrusage, one process per press and share), RSS after the model load, threads, the
load average, versions.

    nice ../kvpress_venv/bin/python experiments/peers_kvpress/run_press.py --press snapkv --kept 0.34 \\
        --samples experiments/peers_kvpress/samples/smollm2_4096.jsonl \\
        --model ~/.cache/headprune/models/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f \\
        --out experiments/peers_kvpress/raw/snapkv_0.34.json --threads 1
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import time
from importlib.metadata import version
from pathlib import Path

import torch

PRESSES = ("dense", "streaming_llm", "snapkv", "expected_attention", "adakv_expected_attention", "kvzip",
           "duo_attention_on_the_fly")
SINK, RECENT = 128, 256  # DuoAttention's on-the-fly sink / recent sizes (kvpress duo_attention_press.py)


def split_prompt(sample: dict) -> tuple[str, str]:
    """(context, question): the prompt split after the input's last newline (RULER's templates end
    with the question on its own line; the answer prefix follows it)."""
    cut = sample["input"].rfind("\n") + 1
    if cut <= 0 or not sample["context"].startswith(sample["input"][:cut]):
        raise ValueError(f"sample {sample['task']}#{sample['index']}: no newline before the question in `input`")
    return sample["context"][:cut], sample["context"][cut:]


def local_texts(corpus: Path, count: int = 50, chars: int = 3000) -> list[str]:
    """`count` passages of `chars` characters spread over a local text (DuoAttention's on-the-fly
    scoring draws 50 BookSum chapters from the hub, unreachable here)."""
    text = corpus.read_text()
    text = text[: int(len(text) * 0.9)]  # a corpus's training part (headprune's held-out rule: the last 10%)
    step = max(1, (len(text) - chars) // count)
    return [text[i * step: i * step + chars] for i in range(count)]


def make_press(name: str, kept: float, context_tokens: int, duo_corpus: Path | None):
    """The kvpress press for `name` removing 1 - `kept` of the context's KV entries."""
    import kvpress

    ratio = round(1.0 - kept, 6)
    if name == "dense":
        return None
    if name == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio)
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio)
    if name == "expected_attention":
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio)
    if name == "adakv_expected_attention":
        return kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=ratio))
    if name == "kvzip":
        return kvpress.KVzipPress(compression_ratio=ratio)
    if name == "duo_attention_on_the_fly":
        import pandas as pd

        import kvpress.presses.duo_attention_press as duo

        if duo_corpus is None:
            raise ValueError("duo_attention_on_the_fly needs --duo-corpus (a local text for its head scoring)")
        texts = local_texts(duo_corpus)
        duo.load_dataset = lambda *a, **k: _Frame(pd.DataFrame({"chapter": texts}))  # the hub's BookSum, replaced
        # its compression_ratio is head share x (1 - (sink + recent) / context): pick the head share
        head_ratio = min(1.0, ratio / (1 - (SINK + RECENT) / context_tokens))
        return kvpress.DuoAttentionPress(head_compression_ratio=head_ratio, on_the_fly_scoring=True)
    raise ValueError(f"--press {name!r}: allowed: {', '.join(PRESSES)}")


class _Frame:
    """What duo_attention_on_the_fly reads of `load_dataset(...)`: `.to_pandas()`."""

    def __init__(self, frame):
        self.frame = frame

    def to_pandas(self):
        return self.frame


def native_tokens(config, context: int) -> int:
    """Tokens over all layers the model's own cache (transformers' DynamicCache(config=...)) holds
    after a prefill of `context` tokens: a sliding layer (Gemma 3's, `layer_types`) keeps its last
    sliding_window - 1, every other layer all `context`."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return sum(min(context, window - 1) if kind == "sliding_attention" and window else context for kind in types)


def press_kept(kept: float, kept_of: str, config, context_tokens: float) -> float:
    """The share of the context's entries (every layer at `context_tokens`, kvpress's compression_ratio
    basis) a press keeps so that it holds `kept` of `kept_of`'s bytes: `context` (every layer holding
    the whole context) or `native` (what the model's own cache holds: `native_tokens`)."""
    if kept_of == "context" or kept == 1.0:
        return kept
    layers = config.num_hidden_layers
    return round(kept * native_tokens(config, round(context_tokens)) / (layers * context_tokens), 6)


def layer_rotary(model, attention):
    """The rotary embedding a press calls as `module.rotary_emb(x, position_ids)`: the model's, bound to
    the layer's type where the model has one per type (Gemma 3 in transformers 5.2 takes
    `layer_type`, and kvpress 0.5.5 passes none: AttributeError 'None_inv_freq')."""
    import functools
    import inspect

    rotary = model.model.rotary_emb
    kind = getattr(attention, "layer_type", None)
    if kind is not None and "layer_type" in inspect.signature(rotary.forward).parameters:
        return functools.partial(rotary, layer_type=kind)
    return rotary


def native_cache(model, cache):
    """`cache`'s keys and values in the model's own cache (DynamicCache(config=...)), which keeps a
    sliding layer's last window only: what the dense model holds when run as transformers runs it."""
    from transformers import DynamicCache

    native = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        native.update(layer.keys, layer.values, i)
    return native


def cache_bytes(cache) -> tuple[int, list[int]]:
    """(bytes of the cache's key and value tensors, tokens per layer)."""
    total, lengths = 0, []
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):
            total += tensor.numel() * tensor.element_size()
        lengths.append(int(layer.keys.shape[-2]))
    return total, lengths


def prefill(model, context_ids, presses: dict, native: bool = False) -> dict:
    """One prefill of `context_ids`; {config: (cache, masked key indices per layer, compression_ratio)}.

    A single press (or dense: None) runs as kvpress runs it (`with press(model)`). Several presses
    share one prefill: kvpress compresses a layer's cache in a hook after that layer's attention has
    used the full keys, so the prefill's hidden states do not depend on the press, and each press's
    `compress` is called on the same layer inputs it would see alone (its `post_init_from_model`
    first, as its `__call__` does); the dense cache is kept as config "dense" (with `native`, moved into
    the model's own cache, `native_cache`, and the prefill's cache kept as "dense_full_cache": every
    layer's every token, what kvpress's pipeline holds with its default DynamicCache()). Each layer's
    `rotary_emb` is `layer_rotary`'s."""
    from transformers import DynamicCache

    layers = model.model.layers
    if len(presses) == 1:
        (key, press), = presses.items()
        cache = DynamicCache()
        with press(model) if press is not None else contextlib.nullcontext():
            model.model(input_ids=context_ids, past_key_values=cache)
        masked = [getattr(layer.self_attn, "masked_key_indices", None) for layer in layers]
        return {key: (cache, masked, float(press.compression_ratio) if press is not None else 0.0)}
    kept = {key: ([], [], []) for key, press in presses.items() if press is not None}
    for key, press in presses.items():
        if press is not None:
            press.post_init_from_model(model)

    def hook(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        keys, values = cache.layers[module.layer_idx].keys, cache.layers[module.layer_idx].values
        for key, (k_out, v_out, m_out) in kept.items():
            module.masked_key_indices = None
            k, v = presses[key].compress(module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            k_out.append(k)
            v_out.append(v)
            m_out.append(module.masked_key_indices)
        module.masked_key_indices = None
        return output

    hooks = []
    try:
        for layer in layers:
            layer.self_attn.rotary_emb = layer_rotary(model, layer.self_attn)  # as BasePress.__call__ sets it
            hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        dense = DynamicCache()
        model.model(input_ids=context_ids, past_key_values=dense)
    finally:
        for handle in hooks:
            handle.remove()
    out = {}
    for key, (k_out, v_out, m_out) in kept.items():
        cache = DynamicCache()
        for i, (k, v) in enumerate(zip(k_out, v_out)):
            cache.update(k, v, i)
        out[key] = (cache, m_out, float(presses[key].compression_ratio))
    if "dense" in presses:
        out["dense"] = (native_cache(model, dense) if native else dense, [None] * len(layers), 0.0)
    if "dense_full_cache" in presses:
        out["dense_full_cache"] = (dense, [None] * len(layers), 0.0)
    return out


def decode(model, tokenizer, sample: dict, context_tokens: int, question_ids, cache, masked) -> dict:
    """The question and up to max_gen_toks greedy tokens on `cache` (kvpress's generate_answer),
    head-wise masks `masked` set on the attention modules meanwhile."""
    layers = model.model.layers
    for layer, indices in zip(layers, masked):
        layer.self_attn.masked_key_indices = indices
    try:
        positions = torch.arange(context_tokens, context_tokens + question_ids.shape[1]).unsqueeze(0)
        out = model(input_ids=question_ids, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        top = out.logits[0, -1].float().topk(5)
        generated = [int(top.indices[0])]
        stop = model.generation_config.eos_token_id
        stop = set(stop if isinstance(stop, list) else [stop])
        position = positions[:, -1:] + 1
        for i in range(sample["max_gen_toks"] - 1):
            if generated[-1] in stop:
                break
            out = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=cache, position_ids=position + i)
            generated.append(int(out.logits[0, -1].argmax()))
    finally:
        for layer in layers:  # a head-wise press's masks must not leak into the next decode
            layer.self_attn.masked_key_indices = None
    return {"prediction": tokenizer.decode(generated, skip_special_tokens=True), "generated_ids": generated,
            "first_token_top5": {"ids": top.indices.tolist(), "logits": [round(v, 5) for v in top.values.tolist()]}}


def answer(model, tokenizer, sample: dict, presses: dict, native: bool = False) -> dict:
    """{config: the sample's record under that press}: one prefill, one decode per config."""
    context, question = split_prompt(sample)
    context_ids = tokenizer.encode(context, return_tensors="pt", add_special_tokens=False)
    question_ids = tokenizer.encode(question, return_tensors="pt", add_special_tokens=False)
    n = int(context_ids.shape[1])
    start = time.perf_counter()
    with torch.no_grad():
        caches = prefill(model, context_ids, presses, native)
        prefill_s = time.perf_counter() - start
        out = {}
        for key in presses:  # dense (and dense_full_cache) last when shared: the others' caches were copied out of the hooks
            cache, masked, ratio = caches[key]
            held, lengths = cache_bytes(cache)
            entries = sum(int(m[0].numel()) for m in masked if m is not None)
            begin = time.perf_counter()
            record = {"task": sample["task"], "index": sample["index"], "context_tokens": n,
                      "native_bytes": native_tokens(model.config, n) * 2 * model.config.num_key_value_heads
                      * model.config.head_dim * 4,
                      "question_tokens": int(question_ids.shape[1]), "compression_ratio": ratio, "held_bytes": held,
                      "cache_tokens_per_layer": lengths, "masked_entries": entries}
            record.update(decode(model, tokenizer, sample, n, question_ids, cache, masked))
            record.update(prefill_s=round(prefill_s, 2), decode_s=round(time.perf_counter() - begin, 2))
            out[key] = record
    return out


def round_robin(samples: list[dict]) -> list[dict]:
    """The samples task by task in turn (the first of each task, then the second, ...), so a run cut
    short holds as many samples of every task."""
    by_task: dict[str, list[dict]] = {}
    for sample in samples:
        by_task.setdefault(sample["task"], []).append(sample)
    out = []
    for i in range(max(len(v) for v in by_task.values())):
        out.extend(v[i] for v in by_task.values() if i < len(v))
    return out


def load_samples(path: Path, tasks, limit: int | None) -> list[dict]:
    """The samples file's samples of `tasks` (all when empty), the first `limit` of each task (all
    when None), in `round_robin` order; every sample's prompt split (`split_prompt`) before any work."""
    samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if tasks:
        samples = [s for s in samples if s["task"] in tasks]
    if limit is not None:
        taken: dict[str, int] = {}
        kept = []
        for sample in samples:
            if taken.get(sample["task"], 0) < limit:
                taken[sample["task"]] = taken.get(sample["task"], 0) + 1
                kept.append(sample)
        samples = kept
    samples = round_robin(samples)
    for sample in samples:
        split_prompt(sample)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--press", nargs="+", required=True, choices=PRESSES,
                        help="one press (run as kvpress runs it), or several sharing one prefill per sample")
    parser.add_argument("--kept", nargs="+", type=float, default=[1.0],
                        help="shares of the context's KV entries kept (1 - kvpress's compression_ratio); every press at each")
    parser.add_argument("--samples", type=Path, required=True, help="RULER samples, JSON lines (make_samples.py or the ruler helper's)")
    parser.add_argument("--model", type=Path, required=True, help="a plain transformers model folder")
    parser.add_argument("--out", type=Path, required=True, help="folder: one <press>_<kept>.json per config")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tasks", nargs="*", default=None, help="only these tasks (default: every task in the file)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many samples per task")
    parser.add_argument("--kept-of", choices=("context", "native"), default="context",
                        help="what --kept is a share of: every layer holding the whole context (kvpress's compression_ratio), "
                             "or the bytes the model's own cache holds (native: a sliding layer holds its window; "
                             "the press is asked for the share of the context that holds as many bytes; the dense row "
                             "holds the model's own cache, and dense_full_cache kvpress's default one)")
    parser.add_argument("--duo-corpus", type=Path, default=None, help="local text for DuoAttention's on-the-fly head scores")
    args = parser.parse_args()
    for kept in args.kept:
        if not 0 < kept <= 1:
            parser.error(f"--kept {kept}: allowed: shares in (0, 1]")
    configs = [(press, 1.0) if press == "dense" else (press, kept) for press in args.press for kept in args.kept]
    configs = list(dict.fromkeys(sorted(configs, key=lambda c: c[0] == "dense")))  # dense last, once
    if any(press != "dense" and kept == 1.0 for press, kept in configs):
        parser.error("a press at --kept 1 removes nothing: give shares below 1")
    samples = load_samples(args.samples, args.tasks, args.limit)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    lengths = [len(tokenizer.encode(split_prompt(s)[0], add_special_tokens=False)) for s in samples]
    context_tokens, mean_tokens = max(lengths), sum(lengths) / len(lengths)
    native = args.kept_of == "native"
    if native and len(configs) < 2:
        parser.error("--kept-of native runs the shared prefill: give dense and at least one press")
    asked = {(press, kept): press_kept(kept, args.kept_of, model.config, mean_tokens) for press, kept in configs}
    presses = {f"{press}_{kept:g}": make_press(press, asked[press, kept], context_tokens, args.duo_corpus)
               for press, kept in configs}
    presses = {("dense" if key.startswith("dense") else key): press for key, press in presses.items()}
    if native and "dense" in presses:
        presses["dense_full_cache"] = None
    config = model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4  # float32 K + V
    versions = {}
    for name in ("torch", "transformers", "kvpress"):
        try:
            versions[name] = version(name)
        except Exception:  # noqa: BLE001 - not installed in this venv
            versions[name] = None
    shared = len(presses) > 1
    records = {key: {"press": key.rsplit("_", 1)[0] if not key.startswith("dense") else key,
                     "kept": 1.0 if key.startswith("dense") else float(key.rsplit("_", 1)[1]), "kept_of": args.kept_of,
                     "press_kept": 1.0 if key.startswith("dense") else asked[key.rsplit("_", 1)[0], float(key.rsplit("_", 1)[1])],
                     "press_repr": repr(press), "prefill": "shared with " + ", ".join(k for k in presses if k != key)
                     if shared else "its own (with press(model))", "samples_file": str(args.samples),
                     "model": str(args.model), "threads": args.threads, "versions": versions,
                     "python": platform.python_version(), "dense_bytes_per_token": per_token, "results": []}
               for key, press in presses.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    for i, sample in enumerate(samples):
        answers = answer(model, tokenizer, sample, presses, native)
        for key, record in records.items():
            record["results"].append(answers[key])
            record.update(wall_s=round(time.time() - start, 1), done=i + 1, of=len(samples),
                          ru_maxrss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                          rss_after_load_kib=rss_after_load, loadavg=list(os.getloadavg()))
            path = args.out / f"{key}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, path)  # the raw file is whole after every sample
        print(f"{i + 1}/{len(samples)} {sample['task']}#{sample['index']} " + " | ".join(
            f"{key}: {a['prediction'][:24]!r}" for key, a in answers.items()) + f" ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
