"""Knowledge distillation from the unpruned model while fine-tuning a pruned one (Hinton et al.
2015; as CoFi, Xia et al. 2022, and block movement pruning recover pruned BERTs).

Per example, with student logits s, teacher logits t and temperature T:
    kd   = T^2 * KL(softmax(t / T) || softmax(s / T))          (summed over classes)
    loss = alpha * kd + (1 - alpha) * task_loss + hidden_weight * hidden_mse
For a causal LM the KL is taken per next-token position and averaged over each example's real
targets, exactly as the task loss is. `hidden_mse` (CoFi-style layer matching) is the mean
squared difference of every layer's output hidden states, averaged over real tokens, hidden
units and layers: head pruning keeps every layer, so student layer l is matched with teacher
layer l. The T^2 factor keeps the soft-target gradients on the scale of the hard-target ones.
The KL is the usual direction (teacher distribution first, the student's log-probabilities
scored against it), i.e. the cross-entropy of the student on the teacher's soft targets minus
the teacher's entropy.

Two ways to train: `steps=0` (default) distils during the schedule's fine-tuning epochs (the
LightningModule's training step calls `training_loss`); `steps=N` trains N optimizer steps on the
training text right after each round masks its heads, as a Lightning fit of its own
(`engine.step_fit.fit_steps`: the run's device, precision, strategy and gradient accumulation,
checkpoints every `checkpoint_every` steps that a killed run resumes from): the LLM way, usable
after a retraining-free prune (`schedule.epochs_per_round=0`) and between the rounds of an
iterative one (the schedule's epochs, if it has any, then train on the same loss).
`recovery=lora` (lora.py) is the same with LoRA adapters (`Distilling` holds what both share).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import nn

from headprune.deploy.hf import load_pruned, save_pruned
from headprune.engine.offload import compute_device, offload_of
from headprune.engine.step_fit import EXAMPLE_INDEX, FitPlan, fit_steps
from headprune.heads.adapters import model_shape
from headprune.recovery.base import AFTER_RECOVERY, Recovery, RecoveryContext, trains_after_pruning
from headprune.recovery.teacher_cache import TopKTeacher, build_teacher_cache, cached_kd_loss
from headprune.recovery.trainable import trainable
from headprune.tasks import CLASSIFICATION, MODEL_INPUTS, Task, real_tokens, task_of

log = logging.getLogger(__name__)


@dataclass
class TeacherState:
    """What a distilling recovery holds during a run (never settings): the frozen teacher, and
    its forward time since the last `take_train_stats`."""

    model: nn.Module | None = None
    seconds: float = 0.0
    cache: TopKTeacher | None = None  # teacher_logits=cached: its distributions over the training data


@dataclass
class Distilling(Recovery):
    """The settings and hooks distillation shares (`recovery=distill`, and `recovery=lora` with
    `alpha > 0`). `teacher`: a model folder to distil from; None = the model itself at the end of
    the baseline epochs: the run's one frozen copy of the unpruned model (`ctx.dense`), saved once
    to `<run dir>/teacher/` so a resumed run reloads it. The teacher is `state.model`, never a
    submodule of the student: it is not trained, not in the optimizer and not in checkpoints.
    `steps > 0`: train that many optimizer steps on the training text right after each round
    (a Lightning fit, `engine.step_fit`), with a checkpoint every `checkpoint_every` steps (0: only
    after the last) in `<run dir>/recovery/last.ckpt`; `steps = 0`: train in the schedule's epochs
    (`in_epochs`). `teacher_logits=cached`: the steps read the teacher's top-`teacher_topk`
    distributions, computed once over the training text before the first step
    (`teacher_cache.py`), instead of running the teacher at every step; the run still keeps its
    frozen unpruned copy while a repair stage or the budget needs it."""

    def trains_steps(self) -> bool:
        return self.steps > 0

    def follows_kv_modes(self) -> bool:
        return self.steps > 0  # the steps train the windowed model (its windows attached before them)

    alpha: float = 0.9
    temperature: float = 2.0
    hidden_weight: float = 0.0
    teacher: Optional[str] = None
    steps: int = 0
    lr: float = 5e-5  # peak learning rate of the steps
    max_grad_norm: float = 1.0
    checkpoint_every: int = 20  # about 3-10 minutes of SmolLM2-135M KL steps on 2 CPU cores
    teacher_logits: str = "live"  # live: the teacher runs at every step; cached: its top-k once (teacher_cache.py)
    teacher_topk: Optional[int] = None  # teacher_logits=cached: the top-k kept (null: DEFAULT_TOPK)

    DEFAULT_TOPK: ClassVar[int] = 64

    TEACHER_DIR: ClassVar[str] = "teacher"
    record_key: ClassVar[str] = "distill"  # results.json round entry of the steps' report

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"recovery.alpha={self.alpha!r} must be in [0, 1]: the weight of the distillation term")
        if not self.temperature > 0:
            raise ValueError(f"recovery.temperature={self.temperature!r} must be > 0")
        if self.hidden_weight < 0:
            raise ValueError(f"recovery.hidden_weight={self.hidden_weight!r} must be >= 0")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"recovery.steps={self.steps!r} must be an integer >= 0 (0: train in the schedule's epochs)")
        if not self.lr > 0:
            raise ValueError(f"recovery.lr={self.lr!r} must be > 0")
        if not self.max_grad_norm > 0:
            raise ValueError(f"recovery.max_grad_norm={self.max_grad_norm!r} must be > 0")
        if self.teacher_logits not in ("live", "cached"):
            raise ValueError(f"recovery.teacher_logits={self.teacher_logits!r} is not allowed; allowed: live (the "
                             "teacher runs at every step), cached (its top-k distributions computed once)")
        topk = self.teacher_topk
        if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
            raise ValueError(f"recovery.teacher_topk={topk!r} must be an integer >= 1 (or null: {self.DEFAULT_TOPK})")
        if topk is not None and self.teacher_logits != "cached":
            raise ValueError(f"recovery.teacher_topk={topk} sizes the cached teacher, but recovery.teacher_logits="
                             f"{self.teacher_logits!r} runs the whole teacher at every step; allowed: "
                             "teacher_logits=cached, or teacher_topk=null")
        if self.teacher_logits == "cached" and self.steps == 0:
            raise ValueError("recovery.teacher_logits=cached serves a step budget (recovery.steps > 0), whose batches "
                             "it can look up; recovery.steps=0 distils in the schedule's epochs with the live "
                             "teacher: allowed: recovery.steps > 0, or teacher_logits=live")
        if self.teacher_logits == "cached" and self.hidden_weight > 0:
            raise ValueError(f"recovery.teacher_logits=cached keeps the teacher's output distributions only, not its "
                             f"hidden states; recovery.hidden_weight={self.hidden_weight} needs them: allowed: "
                             "teacher_logits=live, or hidden_weight=0")
        every = self.checkpoint_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"recovery.checkpoint_every={every!r} must be an integer >= 0 (optimizer steps between "
                             "checkpoints of a step budget; 0: only after its last step)")
        self.state = TeacherState()

    # -- what it needs ---------------------------------------------------------------------------
    @property
    def uses_teacher(self) -> bool:
        """Whether a teacher term is on (the KL, or layer matching): its teacher is loaded, kept and
        reloaded on resume."""
        return self.alpha > 0 or self.hidden_weight > 0

    @property
    def in_epochs(self) -> bool:
        """Trains in the schedule's epochs (steps = 0), not for a step budget after each round."""
        return self.steps == 0

    @property
    def needs_dense(self) -> bool:
        return self.uses_teacher and self.teacher is None

    @property
    def keeps_dense(self) -> bool:
        """A cached teacher is built in `before_first_round`: the unpruned copy is not needed after it."""
        return self.needs_dense and not self.caches_teacher

    @property
    def topk(self) -> int:
        """The cached teacher's k (`teacher_topk`, or DEFAULT_TOPK when null)."""
        return self.teacher_topk if self.teacher_topk is not None else self.DEFAULT_TOPK

    @property
    def caches_teacher(self) -> bool:
        return self.uses_teacher and self.teacher_logits == "cached"

    @property
    def trains(self) -> bool:  # through the schedule's epochs
        return self.in_epochs

    @property
    def needs_train_data(self) -> bool:
        return not self.in_epochs

    # -- hooks -----------------------------------------------------------------------------------
    def check(self, schedule) -> None:
        name = self.record_key
        if self.in_epochs and schedule.num_rounds and not trains_after_pruning(schedule):
            raise ValueError(f"recovery={name} trains after each round, but the schedule has no epochs after pruning "
                             "(schedule.epochs_per_round=0, schedule.recover_epochs=0); allowed: either > 0, or "
                             f"recovery.steps > 0 (train that many steps after each round, no epochs), or "
                             "recovery=finetune")

    def check_model(self, student: nn.Module) -> None:
        """Load `teacher` as it was saved (never with the student's config overrides) and refuse one
        that cannot teach this student: another task, vocabulary or label set."""
        if not self.uses_teacher or self.teacher is None:
            return
        self.state.model = load_teacher(Path(self.teacher).expanduser(), student, self.hidden_weight,
                                        f"recovery.teacher={self.teacher!r}")

    def check_resume(self, run_dir: Path) -> None:
        """A resumed run reloads the teacher saved when round 1 pruned: refuse, before anything is
        written, a run whose teacher is missing or unreadable."""
        if not self.uses_teacher or self.teacher is not None:
            return
        folder = run_dir / self.TEACHER_DIR
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"resuming this recovery={self.record_key} run needs its teacher, saved when round 1 "
                                    f"pruned, at {folder}; it is missing. Nothing was written. Allowed: start the run "
                                    "again without ckpt_path and with overwrite=true")
        try:
            load_pruned(folder)
        except (OSError, ValueError, RuntimeError) as err:
            raise ValueError(f"resuming this recovery={self.record_key} run needs its teacher at {folder}, which cannot "
                             f"be loaded ({err}). Nothing was written. Allowed: start the run again without ckpt_path "
                             "and with overwrite=true") from None

    def before_first_round(self, ctx: RecoveryContext) -> None:
        if not self.uses_teacher or self.state.model is not None:
            return
        self.state.model = ctx.dense
        folder = ctx.run_dir / self.TEACHER_DIR if ctx.run_dir is not None else None
        if folder is not None and ctx.writer:
            save_pruned(self.state.model, folder, overwrite=True)
        log.info("distillation teacher: the model as round 1 found it%s", f", saved to {folder}" if folder else "")
        if self.caches_teacher:  # its distributions now; the run may then free the unpruned copy
            self.build_cache(ctx)

    def build_cache(self, ctx: RecoveryContext) -> None:
        """teacher_logits=cached: the teacher's top-k over the training text, once; the teacher is let go."""
        self.state.cache = build_teacher_cache(self.state.model, training_loader(ctx.loaders, self.record_key),
                                               ctx.task, self.temperature, self.topk)
        self.state.model = None

    def resume(self, ctx: RecoveryContext) -> nn.Module | None:
        if not self.uses_teacher or self.state.model is not None:
            return None
        folder = ctx.run_dir / self.TEACHER_DIR if ctx.run_dir is not None else None
        if folder is None or not folder.is_dir():
            raise FileNotFoundError(f"resuming a recovery={self.record_key} run needs its teacher, saved when round 1 "
                                    f"pruned, at {folder}; it is missing")
        self.state.model = load_pruned(folder).eval().requires_grad_(False)
        return self.state.model

    def train_and_record(self, ctx: RecoveryContext, record: dict, extra: dict) -> None:
        """Train `steps` steps of `training_loss` on the training text; the report goes to
        `record[record_key]`, the validation metrics after it to `AFTER_RECOVERY`."""
        train = training_loader(ctx.loaders, self.record_key)
        start = time.perf_counter()
        extra = dict(extra)
        if self.caches_teacher:
            if self.state.cache is None:  # a teacher from a folder (recovery.teacher), loaded when checked
                self.build_cache(ctx)
            extra.update(teacher=f"cached top-{self.topk}", teacher_cache_seconds=self.state.cache.seconds)
        plan = ctx.fit if ctx.fit is not None else FitPlan(seed=record["round"])
        plan.checkpoint_every = self.checkpoint_every
        report = fit_steps(ctx.model, train, lambda model, batch: self.training_loss(model, batch, ctx.task)[1].mean(),
                           self.steps, self.lr, self.max_grad_norm, plan=plan,
                           label=f"round {record['round']}: {self.record_key}")
        report.update(extra, **self.take_train_stats(), seconds=round(time.perf_counter() - start, 3))
        record[self.record_key] = report
        if ctx.loaders.val is not None:
            record[AFTER_RECOVERY] = ctx.evaluate(ctx.loaders.val)
        log.info("round %d: %s, %d steps in %.1f s, loss %.4f -> %.4f; val %s", record["round"], self.record_key,
                 self.steps, report["seconds"], report["loss_first"], report["loss_last"], record.get(AFTER_RECOVERY))

    def training_loss(self, model: nn.Module, batch: dict, task: Task) -> tuple[torch.Tensor, torch.Tensor]:
        """`task`'s loss (the run's Task) until a teacher is in; then the mix of the module docstring."""
        if self.state.cache is not None and EXAMPLE_INDEX in batch:  # no teacher forward: its cached top-k
            logits, _ = forward_outputs(model, batch)
            kd = cached_kd_loss(logits, self.state.cache, batch, self.temperature, task)
            return logits, self.alpha * kd + (1 - self.alpha) * task.loss(logits, batch)
        teacher = self.state.model
        if teacher is None:
            return super().training_loss(model, batch, task)
        device = batch["input_ids"].device
        if compute_device(teacher) != device and offload_of(teacher) is None:  # a streamed copy stays in host memory
            teacher.to(device)
        hidden = self.hidden_weight > 0
        logits, student_hidden = forward_outputs(model, batch, hidden)
        start = time.perf_counter()
        with torch.no_grad():
            teacher_logits, teacher_hidden = forward_outputs(teacher, batch, hidden)
        self.state.seconds += time.perf_counter() - start
        return logits, distill_loss(self, task.loss(logits, batch), logits, teacher_logits, batch, student_hidden,
                                    teacher_hidden, task)

    def take_train_stats(self) -> dict:
        seconds, self.state.seconds = self.state.seconds, 0.0
        return {"teacher_seconds": round(seconds, 3)} if seconds else {}


@dataclass
class Distill(Distilling):
    """`recovery=distill`: the distillation mix, every weight trained (module docstring)."""

    def after_round(self, ctx: RecoveryContext, record: dict) -> None:
        """`steps > 0`: train the whole model for `steps` steps on the training text."""
        if self.in_epochs:
            return
        with trainable(ctx.model, lambda name: True):
            self.train_and_record(ctx, record, {})


def load_teacher(folder: Path, student: nn.Module, hidden_weight: float, setting: str) -> nn.Module:
    """The model saved in `folder`, frozen, once it is checked to be able to teach `student`."""
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{setting}: {folder} holds no model (no config.json); "
                                "allowed: a model folder, e.g. <run dir>/export")
    try:
        teacher = load_pruned(folder)
    except (OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{setting} cannot be loaded: {err}") from None
    if task_of(teacher) is not task_of(student):  # a check of two loaded models' heads
        raise ValueError(f"{setting} is a {type(teacher).__name__}, the model being pruned "
                         f"a {type(student).__name__}: a teacher must do the same task")
    for name in ("vocab_size", "num_labels"):
        if getattr(teacher.config, name, None) != getattr(student.config, name, None):
            raise ValueError(f"{setting} has {name}={getattr(teacher.config, name, None)}, "
                             f"the model being pruned {getattr(student.config, name, None)}; they must match")
    layers = model_shape(teacher)[0], model_shape(student)[0]
    if hidden_weight > 0 and layers[0] != layers[1]:
        raise ValueError(f"{setting} has {layers[0]} layers, the model being pruned "
                         f"{layers[1]}: recovery.hidden_weight={hidden_weight} matches hidden states layer by "
                         "layer; allowed: a teacher with as many layers, or recovery.hidden_weight=0")
    return teacher.eval().requires_grad_(False)


def training_loader(loaders, name: str):
    """The training text a step-budget recovery reads, refused when there is none."""
    train = loaders.train
    if train is None or len(getattr(train, "dataset", [None])) == 0:
        raise ValueError(f"recovery={name} with recovery.steps > 0 trains on the training blocks, but there are none "
                         "(data.max_train_samples=0, or no training loader given); allowed: data.max_train_samples > 0 "
                         "or null")
    return train


def forward_outputs(model: nn.Module, batch: dict, hidden: bool = False):
    """(logits, hidden states or None): hidden states are every layer's output, embeddings excluded."""
    inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    out = model(**inputs, output_hidden_states=hidden)
    return out.logits, (out.hidden_states[1:] if hidden else None)


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, batch: dict, temperature: float,
            task: Task = CLASSIFICATION) -> torch.Tensor:
    """(B,) T^2 * KL(teacher || student) at temperature T over the task's scored positions: over
    classes for classification, per next-token position averaged over each example's real
    targets for a causal LM (`Task.positions`, `Task.per_example`)."""
    log_s = F.log_softmax(task.positions(student).float() / temperature, dim=-1)
    log_t = F.log_softmax(task.positions(teacher).float() / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1) * temperature ** 2  # (B,) or (B, T-1)
    return task.per_example(kl, batch)


def hidden_mse(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...], batch: dict) -> torch.Tensor:
    """(B,) mean over layers of the mean squared hidden-state difference over real tokens and units."""
    real = real_tokens(batch).float()  # (B, T)
    per_layer = [((s.float() - t.float()).pow(2).mean(-1) * real).sum(1) / real.sum(1).clamp_min(1.0)
                 for s, t in zip(student, teacher)]  # each (B,)
    return torch.stack(per_layer).mean(0)


def distill_loss(settings: Distilling, task_loss: torch.Tensor, student_logits: torch.Tensor,
                 teacher_logits: torch.Tensor, batch: dict, student_hidden=None, teacher_hidden=None,
                 task: Task = CLASSIFICATION) -> torch.Tensor:
    """(B,) the per-example recovery loss of the module docstring."""
    loss = settings.alpha * kd_loss(student_logits, teacher_logits, batch, settings.temperature, task)
    loss = loss + (1 - settings.alpha) * task_loss
    if settings.hidden_weight > 0:
        loss = loss + settings.hidden_weight * hidden_mse(student_hidden, teacher_hidden, batch)
    return loss
