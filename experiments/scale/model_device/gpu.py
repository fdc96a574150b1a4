"""The device's own peak with the models whole and streamed: one Pruner round (Fisher scores, the
measured allocation under budget=kv, the refit against the dense copy, the heads removed) on a
random-init model of a bench.scale shape, with `model_device=dense_device=run` and `=cpu`, each in
a fresh process, interleaved; the device's peak is `torch.cuda.max_memory_allocated` over the
process (weights, activations, accumulators), against the model's bytes.

    python experiments/scale/model_device/gpu.py --shape smollm2_360m --dtype bfloat16   # on a GPU: gpu.json here
    python experiments/scale/model_device/gpu.py --device cpu --shape llama_tiny --out /tmp/x.json  # the code path only

Shapes are conf/bench.yaml's bench.scale.shapes. On the CPU there is no device peak to read (the
rows say null): that mode only checks the script (tests/test_model_offload.py runs it).
Not yet run on a GPU (none was lent): gpu.json is written when it is.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MIB = 2 ** 20


def one_run(where: str, args: dict, out: str) -> None:
    """In a fresh process: the round with both models at `where`; its figures written to `out`."""
    import torch
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader

    from headprune.bench.decoder import build_decoder
    from headprune.heads.surgery import prune_heads
    from headprune.results import RunResults
    from headprune.scoring import get_metric
    from headprune.selection.layer_policies import MeasuredPolicy
    from headprune.selection.pruner import Loaders, Pruner, RunObserver
    from headprune.selection.schedules import OneShot

    class Surgery(RunObserver):
        def __init__(self, model):
            self.model = model

        def pruned(self, result):
            prune_heads(self.model, result.pruned)

    torch.set_num_threads(args["threads"])
    device = torch.device(args["device"])
    shape = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "bench.yaml").bench.scale.shapes[args["shape"]])
    model = build_decoder(shape, seed=0).to(getattr(torch, args["dtype"]))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if where == "run":
        model.to(device)
    else:
        from headprune.engine.offload import stream_model

        stream_model(model, device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"], (args["samples"], args["seq"]), generator=g)
    loader = DataLoader([{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids],
                        batch_size=args["batch_size"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    pruner = Pruner(model, get_metric("fisher"), OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0),
                    MeasuredPolicy(profile_samples=1, passes=1, candidates=2),
                    {"kind": "kv", "target": args["kv_target"], "seq": args["seq"]}, "refit",
                    results=RunResults(None), dense_device=where, model_device=where, observer=Surgery(model))
    data = pruner.run(Loaders(loader, loader))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    Path(out).write_text(json.dumps({
        "model_device": where, "seconds": time.perf_counter() - start, "model_bytes": model_bytes,
        "device_peak_bytes": peak, "device_peak_ratio": None if peak is None else peak / model_bytes,
        "val": data["final"]["val"], "heads_per_layer": data["final"]["heads_per_layer"],
        "model_residency": data["model_device"], "dense_residency": data.get("dense_copy")}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2_360m")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--kv-target", type=float, default=0.67)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="run / cpu pairs, interleaved")
    parser.add_argument("--out", type=Path, default=HERE / "gpu.json")
    a = parser.parse_args(argv)
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu.py: --device cuda asks for a GPU, but this machine has none; allowed here: --device cpu "
              "(the code path only, no device peak)", file=sys.stderr)
        return 2
    args = {"shape": a.shape, "device": a.device, "dtype": a.dtype, "samples": a.samples, "seq": a.seq,
            "batch_size": a.batch_size, "kv_target": a.kv_target, "threads": a.threads}
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for round_no in range(1, a.rounds + 1):
        for where in ("run", "cpu"):
            out = a.out.with_name(f"{a.out.stem}_{where}_{round_no}.part.json")
            process = ctx.Process(target=one_run, args=(where, args, str(out)))
            process.start()
            process.join()
            if process.exitcode != 0 or not out.is_file():
                print(f"gpu.py: the {where} run {round_no} exited with {process.exitcode}", file=sys.stderr)
                return 1
            rows.append({"round": round_no, **json.loads(out.read_text())})
            out.unlink()
    meta = {"args": args, "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    a.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    for r in rows:
        print(r["round"], r["model_device"], f"{r['seconds']:.1f} s", r["device_peak_ratio"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
