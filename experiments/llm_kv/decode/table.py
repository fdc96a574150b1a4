"""The README's figures, from the committed bench.json files of this folder (never typed by hand):
per export, thread count, batch and prompt, the per-token decode speed-up next to its Amdahl bound,
their ratio, the KV-bytes ratio and the prefill speed-up.
Usage: python experiments/llm_kv/decode/table.py experiments/llm_kv/decode/cpu_threads*/bench.json"""
import json
import sys


def rows(path: str) -> list[str]:
    data = json.load(open(path))
    dense = {(r["threads"], r["batch"], r["prompt_len"]): r for r in data["llm"] if r["variant"] == "dense"}
    out = []
    for r in data["llm"]:
        if r["kind"] != "pruned":
            continue
        d = dense[(r["threads"], r["batch"], r["prompt_len"])]
        prefill = f"{r['prefill_ratio']:.2f}x" if r["prefill_ratio"] else "–"
        out.append(f"| {r['variant']} | {r['threads']} | {r['batch']} | {r['prompt_len']} | {d['per_token_ms']:.1f} "
                   f"| {r['per_token_ms']:.1f} | {r['per_token_ratio']:.2f}x | {r['bound']:.2f}x "
                   f"| {r['ratio_to_bound']:.2f} | {d['attention_share']:.0%} | {r['kv_ratio']:.4f} "
                   f"({'exact' if r['kv_exact'] else 'NOT exact'}) | {prefill} |")
    return out


HEADER = ("| export | threads | batch | prompt | dense ms/token | pruned ms/token | speed-up | bound | speed-up / bound "
          "| attention share (dense) | KV bytes ratio | prefill speed-up |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table(*paths: str) -> str:
    return "\n".join([HEADER] + [row for path in paths for row in rows(path)]) + "\n"


if __name__ == "__main__":
    print(table(*sys.argv[1:]), end="")
