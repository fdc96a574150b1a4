"""engine/offload.py with `model_device=cpu`: the pruned model itself in host memory, one block at a
time on the device, in runs without training (scoring, allocation, reconstructions, surgery,
evaluation, export).

On this CPU-only machine home and device coincide, so the `copying` fixture makes every block move
a real copy (new tensors each way, as a host <-> device transfer does): a weight written to a stale
device copy, or read from one, would then be lost or differ. The tests check that the streamed
run's results (scores, layout, repaired weights, val) equal the unstreamed run's bit for bit, that
at most one block of each model is on the device at any time of the whole run, that a backward
pass through the streamed model (gradients w.r.t. the head mask) keeps no block's device copy
alive, and that the settings a streamed model cannot honour are refused before any work."""
import copy
import json
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.data import DataLoader

from headprune.deploy.hf import load_pruned, save_pruned
from headprune.engine.offload import BlockOffload, dense_copy, offload_of, stream_model
from headprune.heads.mask import HeadMask
from headprune.heads.surgery import prune_heads
from headprune.recovery import Distill, make_recovery
from headprune.recovery.base import Reconstruction
from headprune.results import RunResults
from headprune.scoring import get_metric
from headprune.selection.layer_policies import MeasuredPolicy, UniformPolicy
from headprune.selection.pruner import Loaders, Pruner, RunObserver
from headprune.selection.schedules import OneShot
from tests.helpers import V, tiny


class HomeReads(TorchFunctionMode):
    """Reads of a block's home copy (an inference tensor, `copying`) outside a move. `strict`
    (inside a reconstruction): any op but metadata on one is an error (the block's weights read
    outside `blocks_held`); else (the whole run): an op that mixes one with another tensor of more
    than 0 dimensions is, as it would mix devices on an accelerator (CPU 0-dim scalars mix freely)."""

    moving = False  # set while `copying` moves a block

    def __init__(self, strict: bool):
        super().__init__()
        self.strict = strict

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not HomeReads.moving and getattr(func, "__name__", "") not in METADATA:
            tensors = [v for v in [*args, *kwargs.values()] if isinstance(v, torch.Tensor)]
            tensors += [t for v in [*args, *kwargs.values()] if isinstance(v, (list, tuple)) for t in v
                        if isinstance(t, torch.Tensor)]
            home = [t for t in tensors if t.is_inference()]
            other = [t for t in tensors if not t.is_inference() and t.dim() > 0]
            if home and (other or self.strict):
                raise AssertionError(f"{getattr(func, '__name__', func)} read a block's home copy off the device")
        return func(*args, **kwargs)


METADATA = {"__get__", "size", "dim", "stride", "numel", "is_inference", "data_ptr", "untyped_storage",
            "storage_offset", "__len__", "__hash__", "__eq__",
            "new_zeros",  # output_bias gives every block a zero bias where the block is
            "index_select"}  # surgery slices a block where it is (its index moved there)


reconstruction_after_round = Reconstruction.after_round
pruner_run = Pruner.run


@pytest.fixture
def copying(monkeypatch):
    """Block moves that copy (module docstring); the home copies are inference tensors, so a weight
    written at home instead of on the device (outside `blocks_held`) raises, and `HomeReads` watches
    every Pruner run and reconstruction. Returns weak references to the storages of every copy made
    on the way to the device."""
    to_device: list = []

    def transfer(self, block, device):
        arriving = self.blocks.index(block) not in self.resident

        def fresh(t):
            if arriving:
                out = t.detach().clone()
                to_device.append(weakref.ref(out.untyped_storage()))
                return out
            with torch.inference_mode():  # a home copy: an in-place write to it (not on the device) raises
                return t.detach().clone()

        HomeReads.moving = True
        try:
            with torch.no_grad():
                block._apply(fresh)
        finally:
            HomeReads.moving = False

    def after_round(self, ctx, record):
        with HomeReads(strict=True):
            return reconstruction_after_round(self, ctx, record)

    def run(self, *args, **kwargs):
        with HomeReads(strict=False):
            return pruner_run(self, *args, **kwargs)

    monkeypatch.setattr(BlockOffload, "transfer", transfer)
    monkeypatch.setattr(Reconstruction, "after_round", after_round)
    monkeypatch.setattr(Pruner, "run", run)
    return to_device


def _loader(n: int, seed: int = 0, tokens: int = 12) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (n, tokens), generator=g)
    return DataLoader([{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids], batch_size=2)


class Surgery(RunObserver):
    """What headprune-train's observer does after a round masks its heads: they leave the model."""

    def __init__(self, model):
        self.model = model

    def pruned(self, result) -> None:
        prune_heads(self.model, result.pruned)


def _without_seconds(value):
    if isinstance(value, dict):
        return {k: _without_seconds(v) for k, v in value.items() if "seconds" not in k}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


def _run(tmp_path, streamed: bool, recovery, metric: str = "taylor", layer_policy=None, budget=None):
    model = tiny("llama")
    where = "cpu" if streamed else "run"
    pruner = Pruner(model, get_metric(metric), OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0),
                    layer_policy or UniformPolicy(), budget, make_recovery(recovery), results=RunResults(tmp_path),
                    dense_device=where, model_device=where, observer=Surgery(model))
    data = pruner.run(Loaders(_loader(4), _loader(4, seed=1)))
    return model, pruner, data


RECOVERIES = ["refit", "least_squares", "bias_compensation",
              {"kind": "chain", "stages": ["refit", "least_squares"]}]


def _recovery(spec):
    from headprune.recovery.chain import Chain

    return Chain(stages=spec["stages"]) if isinstance(spec, dict) else spec


def _check_same_run(resident, streamed):
    (model, _, data), (s_model, s_pruner, s_data) = resident, streamed
    assert _without_seconds(s_data["rounds"]) == _without_seconds(data["rounds"])  # scores, layout, repair, val
    assert s_data["final"]["val"] == data["final"]["val"]
    assert s_data["baseline"] == data["baseline"]
    named = dict(model.named_parameters())
    assert list(dict(s_model.named_parameters())) == list(named)
    for name, param in s_model.named_parameters():
        assert param.shape == named[name].shape, name
        assert torch.equal(param, named[name]), name
    assert s_model.config.num_attention_heads == model.config.num_attention_heads


@pytest.mark.parametrize("spec", RECOVERIES, ids=["refit", "least_squares", "bias_compensation", "chain"])
def test_every_reconstruction_on_the_streamed_model_equals_the_resident_run(spec, copying, tmp_path):
    resident = _run(tmp_path / "run", False, _recovery(spec))
    streamed = _run(tmp_path / "cpu", True, _recovery(spec))
    _check_same_run(resident, streamed)
    _, pruner, data = streamed
    blocks = len(offload_of(pruner.model).blocks)
    # the whole run (baseline, scoring with gradients, surgery, repair, evaluations): one block of each model at a time
    assert data["model_device"] == {"where": "cpu", "device": "cpu", "blocks": blocks, "peak_resident_blocks": 1,
                                    "block_moves": offload_of(pruner.model).moves}
    assert data["model_device"]["block_moves"] > 3 * blocks
    assert data["dense_copy"]["peak_resident_blocks"] == 1 and data["dense_copy"]["block_moves"] >= blocks
    assert resident[2]["model_device"] == {"where": "run", "device": "cpu"}
    assert copying  # the moves did copy


def test_the_measured_allocation_on_the_streamed_model_equals_the_resident_run(copying, tmp_path):
    def run(folder, streamed):
        return _run(folder, streamed, "refit", metric="magnitude", layer_policy=MeasuredPolicy(profile_samples=None),
                    budget={"kind": "kv", "target": 0.5, "seq": 16})

    resident, streamed = run(tmp_path / "run", False), run(tmp_path / "cpu", True)
    _check_same_run(resident, streamed)
    assert streamed[2]["rounds"][0]["budget"]["measured"]["forwards"] > 0  # the allocation measured losses
    assert streamed[2]["model_device"]["peak_resident_blocks"] == 1
    assert streamed[2]["dense_copy"]["peak_resident_blocks"] == 1


def test_a_backward_through_the_streamed_model_keeps_no_device_copy_and_gives_the_same_gradient(copying):
    """Gradients w.r.t. the head mask (Fisher, Taylor): the autograd graph refers to the blocks'
    home copies, so no block's device copy outlives its forward, and the gradient is unchanged."""
    resident = tiny("llama")
    model = copy.deepcopy(resident)
    offload = stream_model(model)
    copying.clear()  # the copies made by installing it (blocks sent home)
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(0))
    grads = []
    for m in (resident, model):
        mask = HeadMask.for_model(m)
        with mask.differentiable_gates(2) as gates:
            loss = m(input_ids=ids, labels=ids).loss
            if m is model:
                alive = [ref for ref in copying if ref() is not None]
                tensors = sum(1 for block in offload.blocks for _ in [*block.parameters(), *block.buffers()])
                assert len(copying) == tensors and not alive, f"{len(alive)} of {len(copying)} device copies alive"
            (grad,) = torch.autograd.grad(loss, gates)
        grads.append(grad)
        mask.detach()
    assert torch.equal(grads[0], grads[1]) and bool(grads[0].abs().sum() > 0)
    assert offload.peak_resident == 1 and not offload.resident


def test_the_streamed_model_exports_as_the_resident_one(copying, tmp_path):
    model, _, _ = _run(tmp_path / "run", False, "refit")
    streamed, _, _ = _run(tmp_path / "cpu", True, "refit")
    for m, folder in ((model, tmp_path / "export_run"), (streamed, tmp_path / "export_cpu")):
        save_pruned(m, folder)
    ids = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = (load_pruned(tmp_path / f"export_{w}")(input_ids=ids).logits for w in ("run", "cpu"))
    assert torch.equal(a, b)


def test_a_dense_copy_of_the_streamed_model_is_a_plain_model(copying):
    model = tiny("llama")
    offload = stream_model(model)
    ids = torch.randint(3, V, (2, 10))
    for where in ("run", "cpu"):
        dense = dense_copy(model, where)
        moves = offload.moves
        with torch.no_grad():
            torch.testing.assert_close(dense(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
        assert offload.moves == moves + len(offload.blocks)  # the dense forward moved none of the model's blocks
        assert (offload_of(dense) is not None) == (where == "cpu") and offload_of(dense) is not offload


@pytest.mark.parametrize("kwargs,budget,pattern", [
    ({"model_device": "gpu"}, None, r"pruning.model_device='gpu' is not allowed; allowed: run .*cpu"),
    ({"model_device": "cpu"}, {"kind": "latency"}, r"pruning.model_device=cpu streams .* budget=latency"),
    ({"model_device": "cpu", "schedule": OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=1)}, None,
     r"pruning.model_device=cpu .* but the schedule \(1 epoch\(s\).*allowed: pruning.model_device=run"),
    ({"model_device": "cpu", "recovery": Distill(steps=3)}, None,
     r"pruning.model_device=cpu .* but the recovery's step budget \(recovery.steps=3\) trains the model"),
])
def test_settings_a_streamed_model_cannot_honour_are_refused_before_any_work(kwargs, budget, pattern):
    model = tiny("llama")
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    schedule = kwargs.pop("schedule", OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0))
    recovery = kwargs.pop("recovery", None)
    with pytest.raises(ValueError, match=pattern):
        Pruner(model, get_metric("magnitude"), schedule, UniformPolicy(), budget, recovery, **kwargs)
    assert offload_of(model) is None and before == {name: p.data_ptr() for name, p in model.named_parameters()}


def test_blocks_replaced_by_pass_throughs_stay_home(copying):
    """`capture` (every block a pass-through) moves no block; the measured allocation's loss from
    layer l on carried states moves only blocks l..L-1."""
    from headprune.recovery.blockwise import capture
    from headprune.selection.measured import Probe

    model = tiny("llama")
    offload = stream_model(model)
    mask = HeadMask.for_model(model)
    batch = {"input_ids": torch.randint(3, V, (2, 10)), "attention_mask": torch.ones(2, 10, dtype=torch.long)}
    batch["labels"] = batch["input_ids"]
    capture(model, batch)
    assert offload.moves == 0
    probe = Probe.of(model, mask, [batch])
    for layer, hidden in probe.carried(mask.mask):
        moves = offload.moves
        probe.loss(mask.mask, layer, hidden)
        assert offload.moves - moves == len(offload.blocks) - layer, layer
    assert offload.peak_resident == 1


def test_the_runtime_places_a_streamed_model_without_moving_its_blocks():
    from headprune.engine.runtime import Runtime

    model = Runtime.of({"accelerator": "cpu", "precision": "bf16-true"}).place(tiny("llama"), model_device="cpu")
    offload = offload_of(model)
    assert offload is not None and offload.device == torch.device("cpu") and offload.grads
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and offload.moves == 0
    pruner = Pruner(model, get_metric("magnitude"), OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0),
                    UniformPolicy(), model_device="cpu")
    assert offload_of(pruner.model) is offload  # the Pruner keeps the runtime's offload


def test_kv_modes_on_the_streamed_model_equal_the_resident_run(copying, tmp_path):
    """kv_modes=measured (full / windowed / removed per KV group, measured losses) and its refit."""
    from headprune.selection.kv_modes import KVModes

    def run(folder, streamed):
        model = tiny("llama")
        where = "cpu" if streamed else "run"
        pruner = Pruner(model, get_metric("magnitude"),
                        OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0),
                        MeasuredPolicy(profile_samples=None), {"kind": "kv", "target": 0.5, "seq": 12},
                        make_recovery("refit"), results=RunResults(folder), dense_device=where, model_device=where,
                        kv_modes=KVModes(choice="measured", sink=2, window=4, samples=None))
        return model, pruner, pruner.run(Loaders(_loader(4), _loader(4, seed=1)))

    resident, streamed = run(tmp_path / "run", False), run(tmp_path / "cpu", True)
    _check_same_run(resident, streamed)
    assert streamed[2]["final"]["kv_layout"] == resident[2]["final"]["kv_layout"]
    assert "window" in str(streamed[2]["final"]["kv_layout"]["modes"])
    assert streamed[2]["model_device"]["peak_resident_blocks"] == 1
    assert streamed[2]["dense_copy"]["peak_resident_blocks"] == 1


@pytest.mark.slow
def test_the_cli_streams_both_models_and_exports_what_the_resident_run_exports(tmp_path, data_dir):
    """headprune-train with `pruning.model_device=cpu pruning.dense_device=cpu` on a refit run with
    Taylor scores and physical removal: results.json's rounds and val equal the resident run's, it
    records both models' residency (one block each at a time), and the export holds the same weights."""
    from safetensors.torch import load_file

    from headprune.apps.train import run
    from tests.helpers import TINY_LM_MODEL, compose_train

    untrained = [*TINY_LM_MODEL, "logger=none", "callbacks=none", "data.max_train_samples=16", "data.score_samples=8",
                 "data.max_validation_samples=8", "data.block_size=32", "schedule=one_shot", "metric=taylor",
                 "schedule.baseline_epochs=0", "schedule.epochs_per_round=0", "schedule.target_sparsity=0.5",
                 "recovery=refit", "diagnostics.enabled=false"]
    resident = run(compose_train(tmp_path / "run", data_dir, *untrained))
    streamed = run(compose_train(tmp_path / "cpu", data_dir, *untrained, "pruning.model_device=cpu",
                                 "pruning.dense_device=cpu"))
    assert _without_seconds(streamed["rounds"]) == _without_seconds(resident["rounds"])
    assert streamed["final"]["val"] == resident["final"]["val"]
    assert streamed["model_device"]["where"] == "cpu" and streamed["model_device"]["peak_resident_blocks"] == 1
    assert streamed["dense_copy"]["peak_resident_blocks"] == 1 and resident["model_device"]["where"] == "run"
    weights = [load_file(next((tmp_path / w / "export").glob("*.safetensors"))) for w in ("run", "cpu")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_plain_deep_copy_of_a_streamed_model_is_refused():
    """copy.deepcopy would copy the blocks' hooks, which move the original's blocks: it raises;
    `without_offload` gives a plain copy."""
    from headprune.engine.offload import without_offload

    model = tiny("llama")
    stream_model(model)
    with pytest.raises(RuntimeError, match="copied with host_copy / dense_copy, or inside without_offload"):
        copy.deepcopy(model)
    with without_offload(model):
        plain = copy.deepcopy(model)
    assert offload_of(plain) is None and offload_of(model) is not None
    assert all(not block._forward_pre_hooks for block in plain.model.layers)


@pytest.mark.slow
def test_the_gpu_script_runs_its_code_path_on_the_cpu(tmp_path):
    """experiments/scale/model_device/gpu.py (the device's own peak, whole vs streamed; for a GPU)
    runs on the CPU with no device peak to read: both runs prune and repair alike, the streamed one
    one block of each model at a time; without a GPU, --device cuda exits 2."""
    import subprocess
    import sys

    from tests.helpers import EXPERIMENTS, REPO

    def gpu(*args: str) -> int:
        return subprocess.run([sys.executable, str(EXPERIMENTS / "scale" / "model_device" / "gpu.py"), *args],
                              cwd=REPO, capture_output=True, text=True, timeout=600).returncode

    out = tmp_path / "gpu.json"
    assert gpu("--device", "cpu", "--shape", "llama_tiny", "--dtype", "float32", "--seq", "16", "--samples", "4",
               "--batch-size", "2", "--rounds", "1", "--threads", "1", "--out", str(out)) == 0
    run, cpu = json.loads(out.read_text())["rows"]
    assert (run["model_device"], cpu["model_device"]) == ("run", "cpu") and run["device_peak_bytes"] is None
    assert cpu["val"] == run["val"] and cpu["heads_per_layer"] == run["heads_per_layer"]
    assert cpu["model_residency"]["peak_resident_blocks"] == 1 == cpu["dense_residency"]["peak_resident_blocks"]
    if not torch.cuda.is_available():
        assert gpu("--out", str(tmp_path / "none.json")) == 2 and not (tmp_path / "none.json").exists()
