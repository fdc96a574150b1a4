"""Where a run's work happens: the device, dtype, precision and process group that the `trainer`
config asks for, for a run with or without training.

A run that trains its schedule's epochs hands these settings to its Lightning Trainer; a run that
trains nothing (every retraining-free and LLM run) builds no Trainer, so before this module the
settings were silently ignored there and the model stayed on the CPU in float32. `Runtime` is read
from the same `trainer` block for every run, checked against the machine before any work (a GPU,
a device count or a precision the machine cannot give is refused, naming the setting and what the
machine has), applied to the model (`place`: device, and dtype for `*-true` precisions), to the
LLM evaluations (`autocast` for `*-mixed` precisions) and to each recovery's own fit
(`trainer_kwargs`: Lightning's precision plugin), and recorded in results.json's top-level
`runtime` block (`record`). Under a `*-mixed` precision, scoring and the reconstructions (least
squares, refit, bias compensation) run without autocast, on float32 activations: with them under
bf16 autocast, SmolLM2's refit at 1 of 3 KV groups (attention drop) ended at validation perplexity
308.8 instead of 80.66 (experiments/llm_iterative/autocast_bug).

Accumulators (scores, Gram matrices, losses) keep their own float32/float64 dtype whatever the
model's: the code that sums them casts before summing.
"""
from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

# Lightning's precision names (their short aliases map to these) -> (weight dtype, autocast dtype)
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "32-true": (torch.float32, None), "64-true": (torch.float64, None),
    "bf16-true": (torch.bfloat16, None), "16-true": (torch.float16, None),
    "bf16-mixed": (torch.float32, torch.bfloat16), "16-mixed": (torch.float32, torch.float16),
}
ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed", "half": "16-true"}
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
STRATEGIES = ("auto", "ddp", "ddp_spawn", "ddp_find_unused_parameters_true", "fsdp")


class UnavailableRuntime(ValueError):
    """The `trainer` settings ask for something this machine (or this kind of run) cannot give."""


def machine() -> str:
    """What this machine offers, for refusals: CUDA devices, or none, and the torch build."""
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return f"{torch.cuda.device_count()} CUDA device(s) ({', '.join(names)}), torch {torch.__version__}"
    return f"no CUDA GPU (torch.cuda.is_available() is False; torch {torch.__version__}), {os.cpu_count()} CPU cores"


@dataclass
class Runtime:
    """The resolved `trainer` settings of a run. Build it with `Runtime.of(trainer_cfg)`, which checks
    them; `rank` / `world_size` are filled in once the processes exist (`joined`)."""

    accelerator: str = "cpu"  # "cpu" or "cuda" after resolution
    devices: int = 1
    precision: str = "32-true"
    strategy: str = "auto"
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True
    rank: int = 0
    world_size: int = 1
    extra: dict = field(default_factory=dict)  # trainer settings passed on to recovery fits as they are

    # -- building and checking -----------------------------------------------------------------
    @classmethod
    def of(cls, trainer: Mapping[str, Any] | None) -> "Runtime":
        """The runtime the `trainer` block asks for, refused (`UnavailableRuntime`) when the machine
        cannot give it. Reads accelerator, devices, precision, strategy, accumulate_grad_batches and
        enable_progress_bar; nothing here touches a device."""
        trainer = dict(trainer or {})
        accelerator = str(trainer.get("accelerator", "auto")).lower()
        if accelerator not in ACCELERATORS:
            raise UnavailableRuntime(f"trainer.accelerator={accelerator!r} is not allowed; allowed: "
                                     f"{', '.join(ACCELERATORS)} (this machine has {machine()})")
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise UnavailableRuntime(f"trainer.accelerator={accelerator} asks for a GPU, but this machine has "
                                     f"{machine()}; allowed here: trainer.accelerator=cpu (or auto)")
        resolved = "cuda" if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()) \
            else "cpu"
        devices = _devices(trainer.get("devices", 1), resolved)
        precision = _precision(trainer.get("precision", "32-true"), resolved)
        strategy = str(trainer.get("strategy", "auto") or "auto")
        if strategy not in STRATEGIES:
            raise UnavailableRuntime(f"trainer.strategy={strategy!r} is not allowed for headprune runs; allowed: "
                                     f"{', '.join(STRATEGIES)}")
        if strategy == "fsdp" and resolved != "cuda":
            raise UnavailableRuntime(f"trainer.strategy=fsdp needs CUDA GPUs, but this machine has {machine()}; "
                                     "allowed here: trainer.strategy=ddp (or auto)")
        if devices > 1 and strategy == "auto":
            strategy = "ddp"  # what Lightning picks for several devices
        accumulate = trainer.get("accumulate_grad_batches")
        accumulate = 1 if accumulate is None else accumulate
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise UnavailableRuntime(f"trainer.accumulate_grad_batches={accumulate!r} must be an integer >= 1")
        extra = {k: trainer[k] for k in ("gradient_clip_algorithm", "deterministic", "num_nodes") if trainer.get(k)
                 is not None}
        return cls(resolved, devices, precision, strategy, accumulate, bool(trainer.get("enable_progress_bar", True)),
                   world_size=devices, extra=extra)

    # -- what it means for tensors -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """This process's device: the CPU, or the CUDA device of its local rank."""
        if self.accelerator == "cuda":
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank % max(1, self.devices))))
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model's weights are kept in (float32 under a mixed precision)."""
        return PRECISIONS[self.precision][0]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision][1]

    def place(self, model: torch.nn.Module, model_device: str = "run") -> torch.nn.Module:
        """`model` on this process's device in the weight dtype (in place; returned for chaining).
        `model_device=cpu` (`pruning.model_device`, runs without training): converted in host
        memory, then its small modules on the device and its blocks streamed there one at a time
        (`engine.offload.stream_model`), so the device never holds the whole model."""
        if model_device == "cpu":
            from headprune.engine.offload import stream_model

            stream_model(model.to(device="cpu", dtype=self.dtype), self.device)
            return model
        return model.to(device=self.device, dtype=self.dtype)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Every forward inside runs in the mixed precision's compute dtype (nothing under `*-true`)."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype):
            yield

    def trainer_kwargs(self) -> dict:
        """The Lightning Trainer settings of a fit that runs where this run runs (a recovery's)."""
        return {"accelerator": "gpu" if self.accelerator == "cuda" else "cpu", "devices": self.devices,
                "precision": self.precision, "strategy": self.strategy,
                "accumulate_grad_batches": self.accumulate_grad_batches,
                "enable_progress_bar": self.enable_progress_bar, **self.extra}

    # -- what results.json says ----------------------------------------------------------------
    def record(self) -> dict:
        """results.json `runtime`: what the run actually used."""
        import lightning
        import transformers

        device = self.device
        return {"device": str(device) if device.type == "cpu" else f"cuda:{device.index}",
                "device_name": device_name(device), "dtype": str(self.dtype).removeprefix("torch."),
                "autocast_dtype": None if self.autocast_dtype is None else str(self.autocast_dtype).removeprefix("torch."),
                "precision": self.precision, "strategy": self.strategy, "world_size": self.world_size,
                "accumulate_grad_batches": self.accumulate_grad_batches,
                "torch": str(torch.__version__), "transformers": transformers.__version__,
                "lightning": lightning.__version__, "torch_threads": torch.get_num_threads()}


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name (from /proc/cpuinfo where there is one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _devices(devices: Any, accelerator: str) -> int:
    """`trainer.devices` as a count, refused beyond what the machine has."""
    if devices in ("auto", -1, "-1"):
        return torch.cuda.device_count() if accelerator == "cuda" else 1
    if isinstance(devices, (list, tuple)):
        raise UnavailableRuntime(f"trainer.devices={list(devices)}: a list of device ids is not supported; allowed: "
                                 "a count (e.g. trainer.devices=2) or auto")
    try:
        count = int(devices)
    except (TypeError, ValueError):
        raise UnavailableRuntime(f"trainer.devices={devices!r} is not allowed; allowed: a count >= 1, or auto") from None
    if count < 1:
        raise UnavailableRuntime(f"trainer.devices={devices!r} is not allowed; allowed: a count >= 1, or auto")
    if accelerator == "cuda" and count > torch.cuda.device_count():
        raise UnavailableRuntime(f"trainer.devices={count} asks for {count} GPUs, but this machine has {machine()}; "
                                 f"allowed here: at most {torch.cuda.device_count()}")
    if accelerator == "cpu" and count > (os.cpu_count() or 1):
        raise UnavailableRuntime(f"trainer.devices={count} asks for {count} CPU processes, but this machine has "
                                 f"{os.cpu_count()} cores; allowed here: at most {os.cpu_count()}")
    return count


def _precision(precision: Any, accelerator: str) -> str:
    """`trainer.precision` in Lightning's long form, refused where this machine cannot run it."""
    name = ALIASES.get(str(precision), str(precision))
    if name not in PRECISIONS:
        raise UnavailableRuntime(f"trainer.precision={precision!r} is not allowed; allowed: {', '.join(PRECISIONS)}")
    if accelerator == "cpu" and name in ("16-mixed", "16-true"):
        # Lightning would silently run 16-mixed as bf16-mixed on the CPU: refuse instead of changing it
        raise UnavailableRuntime(f"trainer.precision={precision} (float16) is not run on the CPU; allowed here: "
                                 "32-true, 64-true, bf16-mixed, bf16-true (this machine has "
                                 f"{machine()})")
    if accelerator == "cuda" and name.startswith("bf16") and not torch.cuda.is_bf16_supported():
        raise UnavailableRuntime(f"trainer.precision={precision}: this GPU has no bfloat16 "
                                 f"({torch.cuda.get_device_name(0)}); allowed here: 16-mixed, 32-true")
    return name
