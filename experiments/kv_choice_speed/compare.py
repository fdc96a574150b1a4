"""kv_modes=measured_retrieval's probes on SmolLM2 at 4096 tokens, old against new, on some layers.

The measurement of experiment=llm_kv_modes (its calibration block: Tiny Shakespeare's score block
of 4096 tokens, seed 0; its retrieval block: seed 1) for the probes of `--layers` only, by
- `old` (with --old; hours on a loaded machine): the implementation of main at 1b3b166 (selection/measured.Probe: blocks before the unit
  carried, each probe one model forward from its layer on, whole-block logits, Task.loss),
  kept here as the reference;
- `new`: selection/unit_probes.unit_rises (a layer's probes stacked, the head in token chunks),
each timed, their rises compared with each other and with the committed raw file
experiments/llm_kv_modes/results/measured_retrieval_last.json (its calibration and retrieval rises);
and the unit times a projection of the whole measurement needs: one block on 1 and on 6 rows,
the old head + Task.loss, the new chunked head. Writes --out (JSON) with `uptime` before and after.

    OMP_NUM_THREADS=2 nice python experiments/kv_choice_speed/compare.py --layers 28 29 \
        --out experiments/kv_choice_speed/compare.json
    OMP_NUM_THREADS=2 nice python experiments/kv_choice_speed/compare.py --layers 28 29 --modes window \
        --out experiments/kv_choice_speed/compare_window.json

`--modes window`: the window probes alone, what kv_modes=measured_retrieval measures under removal=last
while every unit windowed fits (selection/kv_modes.removal_unused); block times on 3 rows too (a layer's
window probes stacked).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "experiments/llm_kv_modes/results/measured_retrieval_last.json"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def blocks_of_the_experiment():
    """(model, calibration block, retrieval block) as experiment=llm_kv_modes builds them."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from headprune.apps.config_paths import config_dir
    from headprune.apps.config_schema import register_schemas
    from headprune.models.build import load_tokenizer
    from headprune.runs.spec import RunSpec
    from headprune.data.retrieval import retrieval_batches

    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=llm_kv_modes", "paths.output_dir=/tmp/kv_choice_speed"])
    GlobalHydra.instance().clear()
    spec = RunSpec.from_config(cfg)
    datamodule = spec.data.load(tokenizer=load_tokenizer(spec.model.pretrained))
    datamodule.setup("fit")
    model = spec.model.build(num_labels=datamodule.num_labels).eval()
    calibration = next(iter(datamodule.score_dataloader()))
    calibration = {"input_ids": calibration["input_ids"][:1]}
    extra = retrieval_batches(model.config, calibration["input_ids"].shape[1], 64, 448, 1, "cpu")[0]
    return model, calibration, extra


@torch.no_grad()
def old_rises(model, mask, batch, units, layers, sink=64, window=448):
    """main 1b3b166's measured_rises for `layers` (each probe: Probe.loss from its layer on)."""
    from headprune.heads.windows import KVWindows
    from headprune.recovery.blockwise import capture
    from headprune.selection.measured import Probe
    from headprune.selection.unit_probes import single_unit
    from headprune.tasks import CAUSAL_LM

    probe = Probe(model, mask, [batch], [capture(model, batch)], CAUSAL_LM)
    base = mask.mask.detach().clone()
    base_loss = probe.loss(base)
    removed, windowed = {}, {}
    for layer, hidden in probe.carried(base):
        if layer not in layers:
            continue
        removed[layer], windowed[layer] = [], []
        for u, heads in enumerate(units):
            trial = base.clone()
            trial[layer, heads] = 0.0
            removed[layer].append(probe.loss(trial, layer, hidden) - base_loss)
            windows = KVWindows(single_unit(mask.num_layers, len(units), layer, u, sink, window)).attach(model)
            try:
                windowed[layer].append(probe.loss(base, layer, hidden) - base_loss)
            finally:
                windows.detach()
        if layer == max(layers):
            break
    return removed, windowed, base_loss


@torch.no_grad()
def unit_times(model, batch):
    """Seconds of one block on 1 and 6 rows (layer 15), of the old head + Task.loss and of the new
    chunked head on one block of `batch`, under the same load as the probes."""
    from headprune.recovery.blockwise import capture, run_block
    from headprune.selection.unit_probes import head_losses, stacked_inputs
    from headprune.tasks import CAUSAL_LM

    inputs = capture(model, batch)
    six = stacked_inputs(inputs, 6)
    times = {}

    def timed(name, fn):
        start = time.perf_counter()
        fn()
        times[name] = round(time.perf_counter() - start, 3)

    timed("block_1_row", lambda: run_block(model, 15, inputs, inputs.hidden))
    timed("block_6_rows", lambda: run_block(model, 15, six, six.hidden))
    three = stacked_inputs(inputs, 3)
    timed("block_3_rows", lambda: run_block(model, 15, three, three.hidden))
    hidden = inputs.hidden

    def old_head():
        from headprune.selection.measured import start_at
        from headprune.tasks import forward_logits

        with start_at(model, 30, hidden):
            CAUSAL_LM.loss(forward_logits(model, batch), batch)

    timed("head_old", old_head)
    timed("head_new", lambda: head_losses(model, batch, hidden, 1))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", choices=["both", "window"], default="both",
                        help="probe both modes (removed, window) or the window alone")
    parser.add_argument("--old", action="store_true", help="also rerun the old implementation (hours under load)")
    args = parser.parse_args()
    from headprune.heads.mask import HeadMask
    from headprune.heads.surgery import kv_group_heads
    from headprune.selection.unit_probes import unit_rises

    modes = ("removed", "window") if args.modes == "both" else ("window",)
    if args.old and args.modes != "both":
        parser.error("--old reruns both modes; use --modes both")
    record = {"layers": args.layers, "modes": list(modes), "threads": torch.get_num_threads(), "uptime_start": uptime(),
              "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    model, calibration, extra = blocks_of_the_experiment()
    mask = HeadMask.for_model(model)
    units = kv_group_heads(model)
    reference = json.loads(REFERENCE.read_text())["rounds"][0]["budget"]["kv_modes"]
    record["unit_times"] = unit_times(model, calibration)
    for name, batch in (("calibration", calibration), ("retrieval", extra)):
        start = time.perf_counter()
        rises, base = unit_rises(model, mask, [batch], units, 64, 448, modes, layers=set(args.layers))
        new_seconds = time.perf_counter() - start
        part = {"new_seconds": round(new_seconds, 3), "base_loss": {"new": base, "committed": reference[name]["base_loss"]},
                "layers": {}}
        for layer in args.layers:
            part["layers"][str(layer)] = {f"{mode}_rise": {"new": rises[mode][layer],
                                                           "committed": reference[name][f"{mode}_rise"][layer]}
                                          for mode in modes}
        pairs = [("new", "committed")]
        if args.old:
            start = time.perf_counter()
            removed, windowed, old_base = old_rises(model, mask, batch, units, set(args.layers))
            part["old_seconds"] = round(time.perf_counter() - start, 3)
            part["base_loss"]["old"] = old_base
            for layer in args.layers:
                part["layers"][str(layer)]["removed_rise"]["old"] = removed[layer]
                part["layers"][str(layer)]["window_rise"]["old"] = windowed[layer]
            pairs += [("new", "old"), ("old", "committed")]
        for pair in pairs:
            part[f"max_abs_difference_{pair[0]}_{pair[1]}"] = max(
                abs(a - b) for entry in part["layers"].values() for kind in entry.values()
                for a, b in zip(kind[pair[0]], kind[pair[1]]))
        record[name] = part
        print(name, json.dumps({k: v for k, v in part.items() if k != "layers"}), flush=True)
    record["uptime_end"] = uptime()
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
