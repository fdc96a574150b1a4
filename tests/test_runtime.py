"""engine/runtime.py: every run puts its work where the `trainer` settings say, or refuses before
any work; results.json's `runtime` block says what was used."""
import json

import pytest
import torch
from safetensors import safe_open

from headprune.apps.train import run
from headprune.engine.runtime import Runtime, UnavailableRuntime
from tests.helpers import TINY_LM_MODEL, compose_train, train_cli

# a tiny causal LM pruned in one round without training (the LLM runs' shape)
UNTRAINED = [*TINY_LM_MODEL, "logger=none", "callbacks=none", "data.max_train_samples=16", "data.score_samples=8",
             "data.max_validation_samples=8", "data.block_size=32", "schedule=one_shot", "schedule.baseline_epochs=0",
             "schedule.epochs_per_round=0", "schedule.target_sparsity=0.5", "recovery=none",
             "diagnostics.enabled=false"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU can give trainer=gpu")
def test_a_gpu_run_on_a_machine_without_one_exits_2_before_writing(tmp_path, data_dir):
    """`trainer=gpu` on a CPU machine: exit 2, the setting and what the machine has named, and no
    file in the run dir (it used to run on the CPU in float32 and record gpu / bf16-mixed)."""
    out = tmp_path / "run"
    result = train_cli(*UNTRAINED, f"data.data_dir={data_dir}", "trainer=gpu", f"hydra.run.dir={out}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "trainer.accelerator=gpu asks for a GPU, but this machine has no CUDA GPU" in result.stderr
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("settings,pattern", [
    ({"accelerator": "tpu"}, r"trainer.accelerator='tpu' is not allowed; allowed: auto, cpu, gpu, cuda"),
    ({"accelerator": "cpu", "precision": "16-mixed"}, r"trainer.precision=16-mixed \(float16\) is not run on the CPU"),
    ({"accelerator": "cpu", "precision": "8-bit"}, r"trainer.precision='8-bit' is not allowed; allowed: 32-true"),
    ({"accelerator": "cpu", "devices": 4096}, r"trainer.devices=4096 asks for 4096 CPU processes"),
    ({"accelerator": "cpu", "devices": 0}, r"trainer.devices=0 is not allowed"),
    ({"accelerator": "cpu", "strategy": "fsdp"}, r"trainer.strategy=fsdp needs CUDA GPUs"),
    ({"accelerator": "cpu", "strategy": "horovod"}, r"trainer.strategy='horovod' is not allowed"),
    ({"accelerator": "cpu", "accumulate_grad_batches": 0}, r"trainer.accumulate_grad_batches=0 must be"),
])
def test_settings_the_machine_cannot_give_are_refused_by_name(settings, pattern):
    with pytest.raises(UnavailableRuntime, match=pattern):
        Runtime.of(settings)


def test_precisions_map_to_weights_and_autocast():
    assert (Runtime.of({"accelerator": "cpu"}).dtype, Runtime.of({"accelerator": "cpu"}).autocast_dtype) == \
        (torch.float32, None)
    mixed = Runtime.of({"accelerator": "cpu", "precision": "bf16-mixed"})
    assert (mixed.dtype, mixed.autocast_dtype) == (torch.float32, torch.bfloat16)
    assert Runtime.of({"accelerator": "cpu", "precision": "bf16"}).precision == "bf16-mixed"
    assert Runtime.of({"accelerator": "cpu", "precision": "bf16-true"}).dtype == torch.bfloat16
    assert Runtime.of({"accelerator": "cpu", "devices": 2}).strategy == "ddp"  # Lightning's choice for several devices
    with mixed.autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16


def _export_dtypes(run_dir) -> set[str]:
    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def test_an_untrained_run_records_and_uses_its_runtime(tmp_path, data_dir):
    """A run without training used to ignore `trainer` entirely. Float32 by default; bf16-true keeps
    the weights (and the export) in bfloat16; bf16-mixed keeps float32 weights, scores and repairs
    on float32 activations and trains a recovery's steps in bfloat16; the block says which."""
    plain = run(compose_train(tmp_path / "fp32", data_dir, *UNTRAINED, "trainer.accelerator=cpu"))
    block = plain["runtime"]
    assert block["device"] == "cpu" and block["dtype"] == "float32" and block["precision"] == "32-true"
    assert block["world_size"] == 1 and block["strategy"] == "auto" and block["torch"] == torch.__version__
    assert block["device_name"] and block["autocast_dtype"] is None
    assert json.loads((tmp_path / "fp32" / "results.json").read_text())["runtime"] == block
    assert _export_dtypes(tmp_path / "fp32") == {"F32"}

    true = run(compose_train(tmp_path / "bf16", data_dir, *UNTRAINED, "trainer.precision=bf16-true"))
    assert true["runtime"]["dtype"] == "bfloat16" and _export_dtypes(tmp_path / "bf16") == {"BF16"}

    steps = ["recovery=distill", "recovery.steps=2", "data.max_train_samples=16"]
    mixed = run(compose_train(tmp_path / "mixed", data_dir, *UNTRAINED, *steps, "trainer.precision=bf16-mixed"))
    assert mixed["runtime"]["dtype"] == "float32" and mixed["runtime"]["autocast_dtype"] == "bfloat16"
    assert _export_dtypes(tmp_path / "mixed") == {"F32"}
    # scoring and the reconstructions read float32 activations; the recovery's steps train in bf16
    assert mixed["baseline"]["val"] == plain["baseline"]["val"]
    assert mixed["rounds"][0]["distill"]["precision"] == "bf16-mixed"


@pytest.mark.slow
def test_a_trained_run_records_its_trainers_runtime(tmp_path, data_dir, monkeypatch):
    """...and after the fit, whose teardown moves the module to the CPU, puts it back on the
    runtime's device before the export and its evaluation (on a GPU they ran on the CPU). Seen
    on CPU as: a `to(runtime.device)` after the fit's teardown."""
    from lightning.pytorch.strategies.strategy import Strategy

    from headprune.lightning.module import HeadPruneModule

    events, original_teardown, original_to = [], Strategy.teardown, HeadPruneModule.to

    def teardown(self):
        events.append("teardown")
        return original_teardown(self)

    def to(self, *args, **kwargs):
        events.append(("to", args, tuple(kwargs.items())))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(Strategy, "teardown", teardown)
    monkeypatch.setattr(HeadPruneModule, "to", to)
    res = run(compose_train(tmp_path, data_dir, *UNTRAINED, "schedule.epochs_per_round=1", "recovery=finetune",
                            "trainer.accelerator=cpu", "trainer.num_sanity_val_steps=0"))
    assert res["runtime"]["device"] == "cpu" and res["runtime"]["world_size"] == 1
    assert res["runtime"]["precision"] == "32-true"
    after = events[events.index("teardown") + 1:]
    assert ("to", (torch.device("cpu"),), ()) in after


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; on a lent one experiments/device_check/"
                    "smoke.py's `trained` case runs the same (smoke_h200_9b74e30.log: it failed there before the fix)")
def test_a_trained_cost_budget_run_on_a_gpu_decides_on_the_cpu(tmp_path, data_dir):
    """Pruning inside a fit on a GPU under a cost budget: the gates are on cuda, the scores on the
    CPU; `HeadMask.alive()` is a CPU tensor, so the budget's allocation indexes one device (it
    stopped with `indices should be either on cpu or on the same device`)."""
    res = run(compose_train(tmp_path, data_dir, *UNTRAINED, "schedule.epochs_per_round=1", "recovery=finetune",
                            "budget=kv", "budget.target=0.5", "budget.seq=32", "trainer.accelerator=gpu",
                            "trainer.num_sanity_val_steps=0"))
    assert res["runtime"]["device"].startswith("cuda")
    assert res["final"]["cost_share"] <= 0.5 + 1e-9
