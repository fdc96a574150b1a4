"""`headprune-export`: a pruned model as ONNX, checked against PyTorch with ONNX Runtime, or as GGUF.

    headprune-export outputs/<run dir> --onnx model.onnx        # the run's export/ folder
    headprune-export <a save_pruned folder> --onnx model.onnx
    headprune-export <folder> --onnx-decode decode.onnx         # causal LMs: the KV-cache decode graph
    headprune-export <folder> --onnx model.onnx --onnx-decode decode.onnx
    headprune-export <run dir or folder> --gguf model.gguf [--gguf-weights f16|f32|q8_0]
    headprune-export <folder> --gguf model.gguf --check [--check-text input.txt --check-held-out 0.1]
    headprune-export <run dir or folder> --vllm-deci deci/      # vLLM DeciLMForCausalLM checkpoint
    headprune-export <run dir or folder> --vllm-anymodel any/   # vLLM AnyModel checkpoint (per-layer KV heads)

--gguf (Llama-family causal LMs) writes a GGUF file llama.cpp serves (deploy/gguf_export.py):
architecture `llama` when every layer keeps the same heads, `deci` when layers differ (0 heads:
an attention-free layer), `granite_swa` when whole layers are windowed (a layer-granular KV
layout with sink 0: llama.cpp sliding-window layers; per-head windows and sinks are refused);
the vocabulary and chat template are copied from the GGUF the dense
model came from (model=smollm2) or written from the folder's tokenizer. --vllm-deci writes vLLM's
DeciLMForCausalLM checkpoint (deploy/vllm_deci.py: layers keeping all their KV groups or none) in
the model's dtype, with the folder's tokenizer. --vllm-anymodel writes vLLM's AnyModel checkpoint
(deploy/vllm_anymodel.py: Llama / Mistral / Qwen2 / Qwen3 removal layouts, per-layer query and KV
heads, attention-free layers as no-op attention) in the model's dtype, with the folder's tokenizer.
A layout or model a format cannot express exits 2 with the reason before anything is written.

Every target is checked before any work, exit 2 with the reason: a path inside the model folder
being exported (a run without training keeps no other copy of the pruned model), an existing file
or folder that is not what the option writes (an earlier GGUF, ONNX graph, --vllm-deci or
--vllm-anymodel checkpoint is replaced; results.json is not), a folder that cannot be written, the same path for
two outputs. A staging file or folder a killed export left beside a target (`.<name>.*.tmp`) is
removed by the next export to that target (atomic.py).

--onnx writes the full-sequence graph (input_ids, attention_mask -> logits) and compares ONNX
Runtime's logits with PyTorch's on a batch of another shape than the export's. --onnx-decode
(causal LMs only) writes the decode graph with past key/values (deploy/onnx_decode.py) and
compares a prefill and --decode-steps greedy decode steps with PyTorch's own KV cache. Each check
passes when all of these hold (deploy/onnx.py `agreement`):

  max_abs_diff = max |ONNX Runtime - PyTorch| over the compared logits  <= --tolerance (absolute)
  rel_diff     = max_abs_diff / max |PyTorch logit|                      <= --rel-tolerance
  argmax_agreement (positions whose argmax, class or next token, is equal) >= --min-argmax-agreement
  and, for the decode graph: equal greedy tokens, and every layer's ONNX past has the KV heads
  the pruned PyTorch model keeps.

--check (with --gguf) runs the written file in llama.cpp as users serve it (flash attention, F16
KV cache, 1 thread) against the PyTorch model in float32 on --check-windows windows of --check-seq
tokens (seeded random ids, or --check-text's tokens from --check-held-out's share on) and passes
when all of these hold (deploy/gguf_check.py): |llama.cpp perplexity / PyTorch's - 1| <=
--gguf-max-ppl-change, argmax agreement >= --gguf-min-argmax, and llama.cpp's cache holds the K/V
bytes per token per layer the layout predicts; the file's size and the logit differences are
reported (--check-exact: also without flash attention on an F32 cache). Without llama-cpp-python,
--check exits 2 naming the pip line, before anything is written.

Prints the figures and writes them beside each file as <name>.check.json (with the export's
seconds and bytes); exits 1 when a check fails, saying which bound on stderr. Each graph is
exported and checked in a temporary folder and only then moved over an earlier file at its path
(deploy/onnx_files.py): an interrupted export leaves the earlier graph, its weights file
(<name>.onnx.<8 hex>.data) and its check as they were. Graphs are exported in float32 (the check
json's `dtype`, the saved model's `source_dtype`): ONNX Runtime's CPU kernels do not run a
bfloat16 graph. Arguments that cannot work (a missing source, a run dir without an export, a
negative or non-finite tolerance, a --min-argmax-agreement outside [0, 1], an output path that
is a folder or lies under a file, the same path twice, --onnx-decode for an encoder or a
sliding-window decoder, no output at all) exit 2 before the export.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from headprune.apps.export_targets import OUTPUTS, argument_problem, target_path, target_problem


def model_folder(path: Path) -> Path:
    """A run dir's export/ folder, or the folder itself; a FileNotFoundError saying what to do
    when there is no model to export."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder; allowed: a headprune-train run dir (results.json) "
                                "or a save_pruned folder (config.json)")
    if (path / "results.json").is_file():
        export = path / "export"
        if not (export / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a run dir without an exported model ({export}): {_no_export(path)}")
        return export
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is neither a run dir (results.json) nor a model folder (config.json)")
    return path


def _no_export(run: Path) -> str:
    """Why a run dir holds no export, read from its results.json, and what to do."""
    try:
        data = json.loads((run / "results.json").read_text())
    except (OSError, ValueError):
        data = {}
    data = data if isinstance(data, dict) else {}
    if (data.get("config") or {}).get("export", True) is False:
        return "it ran with export=false; run it again with export=true"
    recorded = (data.get("final") or {}).get("export_dir")
    if recorded:
        return f"its results.json records the export at {recorded}, which holds no model (moved or deleted?)"
    checkpoint = run / "checkpoints" / "last.ckpt"
    again = (f"resume it with ckpt_path={checkpoint}" if checkpoint.is_file() else
             "it wrote no checkpoint, so run it again with overwrite=true")
    return (f"the run did not finish (killed, failed or still running: results.json has no final export); {again}, "
            "and export it once it has finished")


def main(argv: list[str] | None = None) -> int:
    from headprune.deploy.gguf_check import MAX_PPL_CHANGE as GGUF_MAX_PPL_CHANGE
    from headprune.deploy.gguf_check import MIN_ARGMAX as GGUF_MIN_ARGMAX
    from headprune.deploy.onnx import ABS_TOLERANCE, MIN_ARGMAX_AGREEMENT, REL_TOLERANCE

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a headprune-train run dir or a save_pruned folder")
    parser.add_argument("--onnx", type=Path, help="the full-sequence .onnx file to write")
    parser.add_argument("--onnx-decode", type=Path,
                        help="causal LMs: the decode-graph .onnx file to write (past key/values in, present out)")
    parser.add_argument("--tolerance", type=float, default=ABS_TOLERANCE,
                        help=f"largest allowed max |ONNX Runtime - PyTorch| logit (absolute; default {ABS_TOLERANCE:g})")
    parser.add_argument("--rel-tolerance", type=float, default=REL_TOLERANCE,
                        help=f"largest allowed max |ONNX Runtime - PyTorch| / max |PyTorch logit| (default {REL_TOLERANCE:g})")
    parser.add_argument("--min-argmax-agreement", type=float, default=MIN_ARGMAX_AGREEMENT,
                        help="smallest allowed fraction of compared positions whose argmax is the same "
                             f"(default {MIN_ARGMAX_AGREEMENT:g}: all)")
    parser.add_argument("--decode-steps", type=int, default=4,
                        help="greedy decode steps the decode graph is checked over (default 4)")
    parser.add_argument("--gguf", type=Path, help="Llama-family causal LMs: the .gguf file to write (llama.cpp)")
    parser.add_argument("--gguf-weights", default="f16", choices=["f32", "f16", "q8_0"],
                        help="weight type of --gguf (default f16; norms and biases stay f32)")
    parser.add_argument("--check", action="store_true",
                        help="with --gguf: run the file in llama.cpp against PyTorch (size, perplexity, argmax "
                             "agreement; deploy/gguf_check.py), written beside it as <name>.check.json")
    parser.add_argument("--check-windows", type=int, default=4, help="--check: token windows compared (default 4)")
    parser.add_argument("--check-seq", type=int, default=128, help="--check: tokens per window (default 128)")
    parser.add_argument("--check-text", type=Path,
                        help="--check: a text file whose first windows (the folder's tokenizer) are compared "
                             "(default: seeded random token ids)")
    parser.add_argument("--check-held-out", type=float,
                        help="--check-text: start at this share of its tokens (the held-out part after "
                             "data.validation_share, e.g. 0.1; default: from the start)")
    parser.add_argument("--check-exact", action="store_true",
                        help="--check: also llama.cpp without flash attention on an F32 cache (reported, not judged)")
    parser.add_argument("--gguf-max-ppl-change", type=float, default=GGUF_MAX_PPL_CHANGE,
                        help=f"--check: largest |llama.cpp perplexity / PyTorch's - 1| (default {GGUF_MAX_PPL_CHANGE})")
    parser.add_argument("--gguf-min-argmax", type=float, default=GGUF_MIN_ARGMAX,
                        help=f"--check: smallest share of positions with the same argmax (default {GGUF_MIN_ARGMAX})")
    parser.add_argument("--vllm-deci", type=Path,
                        help="Llama causal LMs whose layers keep all KV groups or none: the vLLM DeciLMForCausalLM "
                             "checkpoint folder to write (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--vllm-anymodel", type=Path,
                        help="Llama / Mistral / Qwen2 / Qwen3 causal LMs with removed heads (per-layer KV heads, "
                             "attention-free layers): the vLLM AnyModel checkpoint folder to write (config.json, "
                             "model.safetensors, tokenizer)")
    args = parser.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        parser.error(problem)  # exit 2 before the (tens of seconds) export
    try:
        folder = model_folder(args.source)
    except FileNotFoundError as err:
        parser.error(str(err))
    for option in OUTPUTS:
        problem = target_problem(option, target_path(args, option), folder)
        if problem:
            parser.error(problem)
    if args.onnx is not None or args.onnx_decode is not None:
        try:
            from headprune.deploy.onnx import check_onnx, export_onnx, judge
            from headprune.deploy.onnx_decode import check_onnx_decode, export_onnx_decode, judge_decode
        except ImportError as err:  # pragma: no cover - the message is the point
            raise SystemExit(f"headprune-export needs the onnx extra: pip install \"headprune[onnx]\" ({err})") from None
    if args.onnx_decode is not None:
        from transformers import AutoConfig

        from headprune.deploy.onnx_decode import decode_problem

        problem = decode_problem(AutoConfig.from_pretrained(folder))
        if problem:
            parser.error(f"--onnx-decode: {problem}")
    if args.check:
        from headprune.deploy.llamacpp import import_llama_cpp

        try:
            import_llama_cpp()
        except ImportError as err:
            parser.error(f"--check: {err}")
        if args.check_text is not None and _tokenizer(folder) is None:
            parser.error(f"--check-text {args.check_text}: {folder} holds no tokenizer to cut the text with; allowed: "
                         "a folder saved with its tokenizer, or no --check-text (random token ids)")
    from headprune.deploy.hf import load_pruned

    model = load_pruned(folder).eval()
    refusals = model_refusals(args, model)
    if refusals:
        parser.error("; ".join(refusals))  # exit 2, nothing written
    failed: list[str] = []
    if args.check:
        from headprune.deploy.gguf_check import random_windows

        if args.check_text is None:
            windows = random_windows(model.config.vocab_size, args.check_seq, args.check_windows)
        else:  # before the export: a text too short for one window writes nothing
            try:
                windows = _text_windows(folder, args)
            except ValueError as err:
                parser.error(f"--check-text {args.check_text}: {err}; allowed: a longer text or a smaller --check-seq")
    if args.gguf is not None:
        try:
            write_gguf(folder, model, args.gguf, args.gguf_weights)
        except ValueError as err:  # what GGUF cannot express (a vocabulary without merges...): nothing written
            parser.error(f"--gguf {args.gguf}: {err}")
    if args.check:
        gguf_failures = check_written_gguf(folder, model, args, windows)
        if gguf_failures:
            failed.append(f"--gguf {args.gguf}: " + "; ".join(gguf_failures) + " (llama.cpp differs from PyTorch)")
    if args.vllm_deci is not None:
        write_vllm_deci(folder, model, args.vllm_deci)
    if args.vllm_anymodel is not None:
        write_vllm_anymodel(folder, model, args.vllm_anymodel)
    if args.onnx is None and args.onnx_decode is None:
        return _verdict(failed)
    from headprune.deploy.onnx_files import publish, staged_onnx

    source_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if source_dtype != "float32":
        print(f"headprune-export: {folder} holds a {source_dtype} model; exporting and checking it in float32 "
              "(ONNX Runtime's CPU kernels do not run a bfloat16 graph)", file=sys.stderr)
        model = model.float()
    bounds = {"tolerance": args.tolerance, "rel_tolerance": args.rel_tolerance, "min_argmax": args.min_argmax_agreement}
    jobs = []
    if args.onnx is not None:
        jobs.append(("onnx", args.onnx, export_onnx, check_onnx, judge))
    if args.onnx_decode is not None:
        jobs.append(("onnx_decode", args.onnx_decode, export_onnx_decode,
                     lambda m, p: check_onnx_decode(m, p, steps=args.decode_steps), judge_decode))
    for kind, path, export, check, verdict in jobs:
        with staged_onnx(path) as staged:  # exported and checked beside `path`, then moved over it
            start = time.perf_counter()
            export(model, staged)
            seconds = time.perf_counter() - start
            report = {"source": str(folder), kind: str(path), "export_s": round(seconds, 1),
                      "onnx_bytes": None, "dtype": "float32", "source_dtype": source_dtype,  # bytes: publish
                      **check(model, staged)}
            failures = verdict(report, **bounds)
            report.update(bounds={"tolerance": args.tolerance, "rel_tolerance": args.rel_tolerance,
                                  "min_argmax_agreement": args.min_argmax_agreement}, passed=not failures,
                          failures=failures)
            publish(staged, path, report)
        print(json.dumps(report, indent=2))
        if failures:
            failed.append(f"--{kind.replace('_', '-')} {path}: " + "; ".join(failures) + " (ONNX Runtime differs "
                          "from PyTorch)")
    return _verdict(failed)


def _verdict(failed: list[str]) -> int:
    """0 when every check passed; else each failure on stderr and 1."""
    for line in failed:
        print(f"headprune-export: {line}; exit 1", file=sys.stderr)
    return 1 if failed else 0


def model_refusals(args: argparse.Namespace, model) -> list[str]:
    """The outputs the model cannot become, with the reasons, before anything is written."""
    out = []
    if args.gguf is not None:
        from headprune.deploy.gguf_export import gguf_refusal

        reason = gguf_refusal(model)
        if reason:
            out.append(f"--gguf {args.gguf}: {reason}")
    if args.vllm_deci is not None:
        from headprune.deploy.vllm_deci import deci_refusal

        reason = deci_refusal(model)
        if reason:
            out.append(f"--vllm-deci {args.vllm_deci}: {reason}")
    if args.vllm_anymodel is not None:
        from headprune.deploy.vllm_anymodel import anymodel_refusal

        reason = anymodel_refusal(model)
        if reason:
            out.append(f"--vllm-anymodel {args.vllm_anymodel}: {reason}")
    return out


def _tokenizer(folder: Path):
    """The folder's tokenizer, or None when it holds none."""
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(folder)


def write_gguf(folder: Path, model, path: Path, weights: str) -> None:
    """The --gguf export of `folder`'s model (checked by `model_refusals`): the vocabulary from the
    dense model's GGUF when it came from one, else the folder's tokenizer."""
    from headprune.deploy.gguf_export import save_gguf
    from headprune.deploy.hf import read_origin
    from headprune.models.gguf import gguf_source

    origin = read_origin(folder)
    source = gguf_source(origin) if origin else None
    tokenizer = _tokenizer(folder) if source is None else None
    start = time.perf_counter()
    out = save_gguf(model, path, tokenizer=tokenizer, source_gguf=source, weights=weights, overwrite=True)
    print(json.dumps({"source": str(folder), "gguf": str(path), "arch": out.arch, "weights": weights,
                      "gguf_bytes": out.bytes, "export_s": round(time.perf_counter() - start, 1),
                      "vocabulary_from": str(source) if source else "tokenizer", "heads": out.layout.heads,
                      "kv_heads": out.layout.kv_heads, "padded_heads": out.layout.padded_heads,
                      **({"sliding_window": out.layout.window, "sliding_layers": [l for l, w in enumerate(out.layout.swa)
                                                                                   if w]} if out.layout.swa else {}),
                      "f16_fallback": out.f16_fallback}, indent=2))


def _text_windows(folder: Path, args: argparse.Namespace) -> list[list[int]]:
    """--check-text's windows: its tokens (the folder's tokenizer, no special tokens) from
    --check-held-out's share on (the part TextLMDataModule holds out; None: from the start), the
    first --check-windows windows of --check-seq (as every perplexity here is windowed)."""
    from headprune.evaluation.perplexity import text_windows

    cut = text_windows(_tokenizer(folder), args.check_text.read_text(), args.check_seq,
                       max_tokens=args.check_seq * args.check_windows, validation_share=args.check_held_out)
    return cut.ids.tolist()


def check_written_gguf(folder: Path, model, args: argparse.Namespace, windows: list[list[int]]) -> list[str]:
    """--check: the GGUF just written run in llama.cpp against `model` in float32 (deploy/gguf_check.py),
    printed and written beside the file as <name>.check.json (m.gguf: m.check.json); returns the bounds it breaks."""
    import copy

    import torch

    from headprune.atomic import write_json_atomic
    from headprune.deploy.gguf_check import check_gguf, judge_gguf
    from headprune.results import strict

    source_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    reference = model if source_dtype == "float32" else copy.deepcopy(model).to(torch.float32)
    start = time.perf_counter()
    report = {"source": str(folder), "gguf": str(args.gguf), "weights": args.gguf_weights, "source_dtype": source_dtype,
              "tokens_from": str(args.check_text) if args.check_text is not None else "random ids (seed 0)",
              "held_out_share": args.check_held_out, **check_gguf(reference, args.gguf, windows, exact=args.check_exact)}
    failures = judge_gguf(report, args.gguf_max_ppl_change, args.gguf_min_argmax)
    report.update(check_s=round(time.perf_counter() - start, 1),
                  bounds={"max_ppl_change": args.gguf_max_ppl_change, "min_argmax": args.gguf_min_argmax},
                  passed=not failures, failures=failures)
    write_json_atomic(args.gguf.with_suffix(".check.json"), strict(report))
    print(json.dumps(report, indent=2))
    return failures


def write_vllm_deci(folder: Path, model, path: Path) -> None:
    """The --vllm-deci export of `folder`'s model (checked by `model_refusals`), with its tokenizer."""
    from headprune.deploy.vllm_deci import read_block_configs, save_deci

    start = time.perf_counter()
    save_deci(model, path, overwrite=True, tokenizer=_tokenizer(folder))
    config = json.loads((path / "config.json").read_text())
    blocks = read_block_configs(config)
    print(json.dumps({"source": str(folder), "vllm_deci": str(path), "dtype": config.get("dtype"),
                      "export_s": round(time.perf_counter() - start, 1),
                      "attention_free_layers": [i for i, (heads, _, _) in enumerate(blocks) if not heads],
                      "kv_heads": [kv for _, kv, _ in blocks],
                      "bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file())}, indent=2))


def write_vllm_anymodel(folder: Path, model, path: Path) -> None:
    """The --vllm-anymodel export of `folder`'s model (checked by `model_refusals`), with its tokenizer."""
    from headprune.deploy.vllm_anymodel import layer_heads, save_anymodel
    from headprune.heads.adapters import head_layout

    start = time.perf_counter()
    save_anymodel(model, path, overwrite=True, tokenizer=_tokenizer(folder))
    config = json.loads((path / "config.json").read_text())
    heads = layer_heads(model)
    kept = sum(len(layer) for layer in head_layout(model))
    print(json.dumps({"source": str(folder), "vllm_anymodel": str(path), "dtype": config.get("dtype"),
                      "base_architecture": config["base_architecture"], "export_s": round(time.perf_counter() - start, 1),
                      "attention_free_layers": [i for i, (_, kv) in enumerate(heads) if not kv],
                      "heads": [q for q, _ in heads], "kv_heads": [kv for _, kv in heads],
                      "padded_heads": sum(q for q, _ in heads) - kept,
                      "bytes": sum(f.stat().st_size for f in path.iterdir() if f.is_file())}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
