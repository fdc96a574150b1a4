"""llama.cpp against PyTorch on SmolLM2-135M-Instruct and two exports (exports.py): the dense model,
kv67 (uniform, a `llama` GGUF) and drop10 (uneven, a `deci` GGUF), on 8 windows of 512 held-out
Tiny Shakespeare tokens (the held-out part after data.validation_share=0.1, as the experiments).

Per model: F32 GGUF logits against PyTorch's float32 logits, with llama.cpp's flash attention
(as served; F16 cache) and without it (F32 cache: the export's own exactness); argmax agreement;
perplexity from llama.cpp's logits against headprune's `perplexity` on the same windows; and the
perplexity and file size of the F16 and Q8_0 GGUFs (served with flash attention).

Usage: python experiments/llm_kv/decode/llamacpp/agreement.py EXPORTS OUT_JSON   (tables.py renders it)
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ, TOKENS = 512, 4096


def measure(exports: Path) -> dict:
    import numpy as np
    import torch

    from headprune import load_pruned, save_gguf
    from headprune.deploy import llamacpp
    from headprune.evaluation.perplexity import perplexity, text_windows
    from headprune.models.build import build_model, load_tokenizer
    from headprune.models.gguf import gguf_source

    data = Path(os.environ.get("HEADPRUNE_DATA_DIR", "../shared/data"))
    tokenizer = load_tokenizer("smollm2")
    text = (data / "tinyshakespeare" / "input.txt").read_text()
    windows = text_windows(tokenizer, text, seq=SEQ, max_tokens=TOKENS, validation_share=0.1)
    rows = [w.tolist() for w in windows.ids]
    models = {"dense": build_model("smollm2", task="causal_lm").eval()}
    for name in ("kv67", "drop10"):
        models[name] = load_pruned(exports / name / "export").eval()
    results = {"seq": SEQ, "windows": len(rows), "tokens": len(rows) * SEQ, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in models.items():
            start = time.perf_counter()
            with torch.no_grad():
                want = [model(torch.tensor([r])).logits[0].double().numpy() for r in rows]
            entry = {"pytorch_ppl": perplexity(model, windows)["ppl"]}
            for weights in ("f32", "f16", "q8_0"):
                out = save_gguf(model, Path(tmp) / f"{name}_{weights}.gguf", source_gguf=gguf_source("smollm2"),
                                weights=weights)
                entry.update(arch=out.arch, kv_heads=out.layout.kv_heads)
                modes = [("flash", True, "f16")] + ([("exact", False, "f32")] if weights == "f32" else [])
                for mode, flash, cache in modes:
                    loaded = llamacpp.load(out.path, n_ctx=SEQ, cache=cache, flash_attn=flash)
                    got = [llamacpp.logits(loaded, r) for r in rows]
                    key = f"{weights}_{mode}"
                    entry[key] = {
                        "max_abs_diff": float(max(np.abs(g - w).max() for g, w in zip(got, want))),
                        "argmax_agreement": float(np.mean([(g.argmax(1) == w.argmax(1)).mean()
                                                           for g, w in zip(got, want)])),
                        "ppl": llamacpp.perplexity(got, rows), "gguf_bytes": out.bytes,
                        "kv_exact": (llamacpp.kv_rows(loaded).per_token == out.layout.kv_bytes_per_token(
                            llamacpp.CACHE_TYPES[cache][1])) if flash else None}
                    entry[key]["ppl_ratio"] = entry[key]["ppl"] / entry["pytorch_ppl"]
                    loaded.close()
                out.path.unlink()
            entry["seconds"] = round(time.perf_counter() - start, 1)
            results["models"][name] = entry
            print(name, json.dumps(entry), flush=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    import llama_cpp
    import transformers

    results["meta"] = {"commit": head, "load_after": [round(x, 2) for x in os.getloadavg()],
                       "llama_cpp_python": llama_cpp.__version__, "llama_cpp_system": llamacpp.system_info(),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "threads": "llama.cpp n_threads=1; torch: OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "")}
    return results


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(measure(Path(sys.argv[1])), indent=2))
