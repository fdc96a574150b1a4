"""engine/offload.py: `pruning.dense_device=cpu` keeps the run's frozen unpruned copy in host memory
and streams one block at a time to the device. On this CPU-only machine home and device coincide, so
the tests check what holds on any device: the copy shares no storage with the model, a forward and
every repair computes what the resident copy computes, at most one block is resident at a time, the
teacher stays streamed through the KL steps, and bad settings are refused before any work."""
import pytest
import torch
from torch.utils.data import DataLoader

from headprune.engine.offload import BlockOffload, check_dense_device, host_copy, offload_of
from headprune.recovery import Distill, make_recovery
from headprune.results import RunResults
from headprune.scoring import get_metric
from headprune.selection.layer_policies import UniformPolicy
from headprune.selection.pruner import Loaders, Pruner
from headprune.selection.schedules import OneShot
from tests.helpers import V, tiny


def _loader(n: int, seed: int = 0, tokens: int = 12) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (n, tokens), generator=g)
    return DataLoader([{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids], batch_size=2)


def test_the_host_copy_shares_no_storage_and_streams_one_block_at_a_time():
    model = tiny("llama")
    copy = host_copy(model)
    pointers = {p.data_ptr() for p in model.parameters()}
    assert not pointers & {p.data_ptr() for p in copy.parameters()}
    offload = BlockOffload(copy, "cpu")
    ids = torch.randint(3, V, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(copy(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    blocks = len(offload.blocks)
    assert offload.peak_resident == 1 and offload.moves == blocks and not offload.resident
    assert offload_of(copy) is offload


def _run(recovery, dense_device: str, tmp_path):
    model = tiny("llama")
    pruner = Pruner(model, get_metric("magnitude"), OneShot(target_sparsity=0.5, baseline_epochs=0, epochs_per_round=0),
                    UniformPolicy(), None, recovery, results=RunResults(tmp_path), dense_device=dense_device)
    record = pruner.step(0, Loaders(_loader(4), _loader(4, seed=1), train=_loader(8, seed=2)))
    return model, record, pruner


@pytest.mark.parametrize("name", ["refit", "least_squares", "bias_compensation"])
def test_every_reconstruction_on_the_streamed_copy_equals_the_resident_one(name, tmp_path):
    resident, record, _ = _run(make_recovery(name), "run", tmp_path / "run")
    streamed, streamed_record, pruner = _run(make_recovery(name), "cpu", tmp_path / "cpu")
    for a, b in zip(resident.parameters(), streamed.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert streamed_record["val"] == record["val"]
    offload = offload_of(pruner.dense)
    assert offload is not None and offload.moves > 0 and offload.peak_resident == 1
    assert pruner.results.data["dense_copy"] == {"where": "cpu", "device": "cpu", "dtype": "float32"}


def test_the_live_teacher_stays_streamed_through_the_kl_steps(tmp_path):
    def distill():
        return Distill(steps=3, lr=1e-3, alpha=1.0, temperature=1.0)

    resident, record, _ = _run(distill(), "run", tmp_path / "run")
    streamed, streamed_record, pruner = _run(distill(), "cpu", tmp_path / "cpu")
    teacher = pruner.recovery.state.model
    offload = offload_of(teacher)
    assert teacher is pruner.dense and offload is not None
    # three steps of two examples: the teacher's forward streamed every block each step
    assert offload.moves >= 3 * len(offload.blocks) and offload.peak_resident == 1
    assert streamed_record["distill"]["loss_last"] == pytest.approx(record["distill"]["loss_last"], rel=1e-6)
    for a, b in zip(resident.parameters(), streamed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("value,budget,pattern", [
    ("gpu", "heads", r"pruning.dense_device='gpu' is not allowed; allowed: run .*cpu"),
    ("cpu", "latency", r"pruning.dense_device=cpu streams .* budget=latency"),
])
def test_bad_dense_devices_are_refused(value, budget, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_dense_device(value, budget)
    with pytest.raises(ValueError, match=pattern):
        Pruner(tiny("llama"), get_metric("magnitude"), OneShot(target_sparsity=0.5), UniformPolicy(),
               {"kind": budget} if budget != "heads" else None, None, dense_device=value)


def test_the_cli_streams_the_dense_copy_and_refuses_a_bad_device_before_writing(tmp_path, data_dir):
    """`pruning.dense_device=cpu` on a refit run: the run's results equal the resident copy's and
    results.json says where the copy lived; an unknown value fails as every bad setting does (Hydra's
    exit 1, the field and the allowed values named) with nothing in the run dir."""
    from headprune.apps.train import run
    from tests.helpers import TINY_LM_MODEL, compose_train, train_cli

    untrained = [*TINY_LM_MODEL, "logger=none", "callbacks=none", "data.max_train_samples=16", "data.score_samples=8",
                 "data.max_validation_samples=8", "data.block_size=32", "schedule=one_shot",
                 "schedule.baseline_epochs=0", "schedule.epochs_per_round=0", "schedule.target_sparsity=0.5",
                 "recovery=refit", "diagnostics.enabled=false", "export=false"]
    resident = run(compose_train(tmp_path / "run", data_dir, *untrained))
    streamed = run(compose_train(tmp_path / "cpu", data_dir, *untrained, "pruning.dense_device=cpu"))
    assert streamed["final"]["val"] == resident["final"]["val"]
    assert streamed["dense_copy"]["where"] == "cpu" and resident["dense_copy"]["where"] == "run"
    out = tmp_path / "bad"
    result = train_cli(*untrained, f"data.data_dir={data_dir}", "pruning.dense_device=gpu", f"hydra.run.dir={out}")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "pruning.dense_device='gpu' is not allowed; allowed: run" in result.stderr
    assert not out.exists() or not any(out.iterdir())
