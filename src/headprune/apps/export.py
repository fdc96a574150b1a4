"""`headprune-export`: a pruned model as ONNX, checked against PyTorch with ONNX Runtime, or as GGUF.

    headprune-export outputs/<run dir> --onnx model.onnx        # the run's export/ folder
    headprune-export <a save_pruned folder> --onnx model.onnx
    headprune-export <folder> --onnx-decode decode.onnx         # causal LMs: the KV-cache decode graph
    headprune-export <folder> --onnx model.onnx --onnx-decode decode.onnx
    headprune-export <run dir or folder> --gguf model.gguf [--gguf-weights f16|f32|q8_0]

--gguf (Llama-family causal LMs) writes a GGUF file llama.cpp serves (deploy/gguf_export.py):
architecture `llama` when every layer keeps the same heads, `deci` when layers differ (0 heads:
an attention-free layer); the vocabulary and chat template are copied from the GGUF the dense
model came from (model=smollm2) or written from the folder's tokenizer. A layout or model the
format cannot express exits 2 with the reason before anything is written.

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

Prints the figures and writes them beside each file as <name>.check.json (with the export's
seconds and bytes); exits 1 when a check fails, saying which bound on stderr. Each graph is
exported and checked in a temporary folder and only then moved over an earlier file at its path
(deploy/onnx_files.py): an interrupted export leaves the earlier graph, its weights file
(<name>.onnx.<8 hex>.data) and its check as they were. Graphs are exported in float32 (the check
json's `dtype`, the saved model's `source_dtype`): ONNX Runtime's CPU kernels do not run a
bfloat16 graph. Arguments that cannot work (a missing source, a run dir without an export, a
negative or non-finite tolerance, a --min-argmax-agreement outside [0, 1], an output path that
is a folder or lies under a file, the same path twice, --onnx-decode for an encoder or a
sliding-window decoder, neither --onnx nor --onnx-decode) exit 2 before the export.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


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
    args = parser.parse_args(argv)
    problem = argument_problem(args)
    if problem:
        parser.error(problem)  # exit 2 before the (tens of seconds) export
    try:
        folder = model_folder(args.source)
    except FileNotFoundError as err:
        parser.error(str(err))
    if args.gguf is not None:
        write_gguf(parser, folder, args.gguf, args.gguf_weights)
        if args.onnx is None and args.onnx_decode is None:
            return 0
    if args.onnx_decode is not None:
        from transformers import AutoConfig

        from headprune.deploy.onnx_decode import decode_problem

        problem = decode_problem(AutoConfig.from_pretrained(folder))
        if problem:
            parser.error(f"--onnx-decode: {problem}")
    try:
        from headprune.deploy.onnx import check_onnx, export_onnx, judge
        from headprune.deploy.onnx_decode import check_onnx_decode, export_onnx_decode, judge_decode
    except ImportError as err:  # pragma: no cover - the message is the point
        raise SystemExit(f"headprune-export needs the onnx extra: pip install \"headprune[onnx]\" ({err})") from None
    from headprune.deploy.hf import load_pruned
    from headprune.deploy.onnx_files import publish, staged_onnx

    model = load_pruned(folder).eval()
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
    failed = []
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
            failed.append(f"--{kind.replace('_', '-')} {path}: " + "; ".join(failures))
    if not failed:
        return 0
    for line in failed:
        print(f"headprune-export: {line} (ONNX Runtime differs from PyTorch); exit 1", file=sys.stderr)
    return 1


def argument_problem(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot work, checked before the export; None when they can."""
    if args.onnx is None and args.onnx_decode is None and args.gguf is None:
        return ("nothing to write: give --onnx PATH (full-sequence graph), --onnx-decode PATH (causal LMs' decode "
                "graph), --gguf PATH (llama.cpp) or several")
    for name, value in (("--tolerance", args.tolerance), ("--rel-tolerance", args.rel_tolerance)):
        if not math.isfinite(value) or value < 0:
            return f"{name} {value}: allowed: a finite number >= 0"
    if not 0 <= args.min_argmax_agreement <= 1:
        return f"--min-argmax-agreement {args.min_argmax_agreement}: allowed: a fraction in [0, 1]"
    if args.decode_steps < 1:
        return f"--decode-steps {args.decode_steps}: allowed: an integer >= 1"
    if args.onnx is not None and args.onnx_decode is not None and args.onnx.resolve() == args.onnx_decode.resolve():
        return f"--onnx and --onnx-decode are the same path ({args.onnx}); allowed: two different files"
    for name, onnx in (("--onnx", args.onnx), ("--onnx-decode", args.onnx_decode), ("--gguf", args.gguf)):
        if onnx is None:
            continue
        if onnx.is_dir():
            return f"{name} {onnx}: is a folder; allowed: a file path (e.g. {onnx / 'model.onnx'})"
        for parent in onnx.parents:
            if parent.exists():
                if not parent.is_dir():
                    return f"{name} {onnx}: {parent} is a file, not a folder; allowed: a path in a folder"
                break
    return None


def write_gguf(parser: argparse.ArgumentParser, folder: Path, path: Path, weights: str) -> None:
    """The --gguf export of `folder`: refused (exit 2, the reason) before writing when the format cannot
    express it; the vocabulary from the dense model's GGUF when it came from one, else the folder's tokenizer."""
    from headprune.deploy.gguf_export import gguf_refusal, save_gguf
    from headprune.deploy.hf import load_pruned, read_origin
    from headprune.models.gguf import gguf_source

    model = load_pruned(folder).eval()
    reason = gguf_refusal(model)
    if reason:
        parser.error(f"--gguf {path}: {reason}")
    origin = read_origin(folder)
    source = gguf_source(origin) if origin else None
    tokenizer = None
    if source is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    start = time.perf_counter()
    out = save_gguf(model, path, tokenizer=tokenizer, source_gguf=source, weights=weights, overwrite=True)
    print(json.dumps({"source": str(folder), "gguf": str(path), "arch": out.arch, "weights": weights,
                      "gguf_bytes": out.bytes, "export_s": round(time.perf_counter() - start, 1),
                      "vocabulary_from": str(source) if source else "tokenizer", "heads": out.layout.heads,
                      "kv_heads": out.layout.kv_heads, "padded_heads": out.layout.padded_heads,
                      "f16_fallback": out.f16_fallback}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
