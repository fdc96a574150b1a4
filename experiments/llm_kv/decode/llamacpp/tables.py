"""The README tables of this folder, from its raw files: agreement.json (agreement.py) and
bench.json (run.sh). tests/test_gguf_export.py checks that the README holds what these print.

Usage: python experiments/llm_kv/decode/llamacpp/tables.py   (prints both tables)
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def agreement_table(results: dict) -> str:
    """Per model: the logit differences, argmax agreement, perplexities by GGUF weight type, sizes."""
    lines = ["| model | GGUF | KV heads kept | max abs diff, exact (no flash attn, F32 cache) | max abs diff, served "
             "(flash attn) | argmax equal | ppl PyTorch | ppl llama.cpp F32 | F16 | Q8_0 | GGUF MB F32 / F16 / Q8_0 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in results["models"].items():
        sizes = " / ".join(f"{e[f'{w}_flash']['gguf_bytes'] / 1e6:.0f}" for w in ("f32", "f16", "q8_0"))
        ppls = " | ".join(f"{e[f'{w}_flash']['ppl']:.3f} ({(e[f'{w}_flash']['ppl_ratio'] - 1) * 100:+.2f}%)"
                          for w in ("f32", "f16", "q8_0"))
        lines.append(f"| {name} | {e['arch']} | {sum(e['kv_heads'])} | {e['f32_exact']['max_abs_diff']:.1e} | "
                     f"{e['f32_flash']['max_abs_diff']:.1e} | {e['f32_flash']['argmax_agreement']:.4f} | "
                     f"{e['pytorch_ppl']:.3f} | {ppls} | {sizes} |")
    return "\n".join(lines) + "\n"


def decode_table(bench: dict) -> str:
    """Per export and thread count: tokens/s at each context, and at the longest context the speed-up
    over dense, its bound and their ratio (the issue's target: within 5% of the bound); KV cache bytes
    against dense and whether llama.cpp's per-layer bytes equal the layout's. The per-context
    ratios are in bench.md."""
    rows = [r for r in bench["llamacpp"] if r["kind"] != "probe"]
    return "\n".join(decode_lines(rows)) + "\n"


def decode_lines(rows: list[dict], first: str = "variant", label=lambda variant: variant, kv_digits: int = 4) -> list[str]:
    """decode_table's lines for `rows` (bench.json's llamacpp rows, probe left out), one per variant and
    thread count in the order they first appear; `label` names a variant in the `first` column
    (experiments/llm_uneven's results.md shows its allocations this way)."""
    contexts = sorted({r["context"] for r in rows})
    longest = contexts[-1]
    at = {(r["variant"], r["threads"], r["context"]): r for r in rows}
    lines = [f"| {first} | GGUF | threads | " + " | ".join(f"tokens/s at {c}" for c in contexts)
             + f" | x dense at {longest} | bound x | x / bound | KV ratio | KV exact |",
             "|---|---|---:|" + "---:|" * len(contexts) + "---:|---:|---:|---:|---|"]
    for variant, threads in dict.fromkeys((r["variant"], r["threads"]) for r in rows):
        last = at[variant, threads, longest]
        speeds = " | ".join(f"{at[variant, threads, c]['tokens_per_s']:.1f}" for c in contexts)
        exact = all(at[variant, threads, c]["kv_exact"] for c in contexts)
        lines.append(f"| {label(variant)} | {last['arch']} | {threads} | {speeds} | {last['per_token_ratio']:.2f} | "
                     f"{last['bound']:.2f} | {last['ratio_to_bound']:.2f} | {last['kv_ratio']:.{kv_digits}f} | {exact} |")
    return lines


def shares(bench: dict) -> str:
    """llama.cpp's measured attention share of a dense decode step, per threads and context."""
    seen = {(r["threads"], r["context"]): r["dense_attention_share"] for r in bench["llamacpp"]}
    return ", ".join(f"{share:.0%} (threads {t}, context {c})" for (t, c), share in seen.items())


if __name__ == "__main__":
    print(agreement_table(json.loads((HERE / "agreement.json").read_text())))
    bench = json.loads((HERE / "bench.json").read_text())
    print(decode_table(bench))
    print(shares(bench))
