"""GGUF sizes (F16, Q8_0) of the llm_uneven exports and Q8_0's perplexity cost in llama.cpp (issue 29,
section 4), into gguf.json (collect.py shows them in results.md).

    python experiments/llm_uneven/gguf.py [--out experiments/llm_uneven/gguf.json] NAME=RUN_DIR ...

NAME is the row's run name in results.md (`attention_drop_refit_kv67`, `uniform_refit_kv67`, ...),
RUN_DIR a finished headprune-train run (its `export/`). Each export is written as a GGUF with F16 and
with Q8_0 weights (`headprune-export RUN_DIR --gguf FILE --gguf-weights f16|q8_0`: norms and biases
F32; `llama` for a uniform layout, `deci` for an uneven one) into `--files` (outside the
repository), its size recorded, and run in llama.cpp (flash attention, F16
KV cache, as served; 1 thread) on 8 windows of 512 held-out Tiny Shakespeare tokens (the same held-out
part as the experiments, BOS first): the perplexity of each file beside PyTorch's on the same
windows, and Q8_0's cost = its perplexity / F16's - 1. Entries already in the file are replaced,
others kept. A run whose layout GGUF cannot express is recorded with the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

SEQ, TOKENS = 512, 4096
WEIGHTS = ("f16", "q8_0")
HERE = Path(__file__).resolve().parent


def measure(name: str, run: Path, files: Path, rows: list[list[int]], windows) -> dict:
    import torch

    from headprune import load_pruned
    from headprune.deploy import llamacpp
    from headprune.deploy.gguf_export import gguf_layout, gguf_refusal
    from headprune.evaluation.perplexity import perplexity

    start = time.perf_counter()
    model = load_pruned(run / "export").eval()
    refusal = gguf_refusal(model)
    if refusal:
        return {"refused": refusal}
    layout = gguf_layout(model)
    with torch.no_grad():
        entry: dict = {"arch": layout.arch, "kv_heads": layout.kv_heads, "pytorch_ppl": perplexity(model, windows)["ppl"]}
    del model
    for weights in WEIGHTS:
        path = files / f"{name}_{weights}.gguf"
        subprocess.run(["headprune-export", str(run), "--gguf", str(path), "--gguf-weights", weights], check=True)
        loaded = llamacpp.load(path, n_ctx=SEQ, threads=1)
        ppl = llamacpp.perplexity([llamacpp.logits(loaded, r) for r in rows], rows)
        loaded.close()
        entry[weights] = {"gguf_bytes": path.stat().st_size, "ppl": ppl}
    entry["q8_0_ppl_cost"] = entry["q8_0"]["ppl"] / entry["f16"]["ppl"] - 1
    entry["seconds"] = round(time.perf_counter() - start, 1)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    parser.add_argument("--out", type=Path, default=HERE / "gguf.json")
    parser.add_argument("--files", type=Path, default=HERE.parent.parent.parent / "llmruns" / "gguf",
                        help="where the .gguf files are written (outside the repository)")
    args = parser.parse_args()
    from headprune.evaluation.perplexity import text_windows
    from headprune.models.build import load_tokenizer

    data = Path(os.environ.get("HEADPRUNE_DATA_DIR", "../shared/data"))
    text = (data / "tinyshakespeare" / "input.txt").read_text()
    windows = text_windows(load_tokenizer("smollm2"), text, seq=SEQ, max_tokens=TOKENS, validation_share=0.1)
    rows = [w.tolist() for w in windows.ids]
    saved = json.loads(args.out.read_text()) if args.out.is_file() else {}
    saved.update(seq=SEQ, windows=len(rows), tokens=len(rows) * SEQ)
    models = saved.setdefault("models", {})
    for spec in args.runs:
        name, run = spec.split("=", 1)
        args.files.mkdir(parents=True, exist_ok=True)
        models[name] = measure(name, Path(run), args.files, rows, windows)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        models[name]["conditions"] = {"commit": head, "load_after": [round(x, 2) for x in os.getloadavg()],
                                      "threads": "llama.cpp n_threads=1; torch OMP_NUM_THREADS="
                                                 + os.environ.get("OMP_NUM_THREADS", "")}
        print(name, json.dumps(models[name]), flush=True)
        args.out.write_text(json.dumps(saved, indent=2) + "\n")


if __name__ == "__main__":
    main()
