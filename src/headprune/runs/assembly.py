"""A run's pieces assembled from its `RunSpec` once every setting is checked: the data, the model
(checked against the spec: its head does the run's task, the budget and policy fit its shape, the
block fits its positions), the LightningModule, the Pruner and the pruning callback. Nothing here
writes a file."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import lightning as L

from headprune.data import self_calibration
from headprune.engine import Runtime
from headprune.evaluation.llm_suite import EvaluationSettings
from headprune.heads.hybrid import layer_report
from headprune.heads.surgery import count_params
from headprune.heads.verify import set_verify
from headprune.lightning.callbacks import HeadPruning
from headprune.lightning.module import HeadPruneModule
from headprune.models import load_tokenizer
from headprune.results import RunResults
from headprune.runs.preflight import check_model
from headprune.runs.spec import RunSpec
from headprune.scoring.attention import end_of_sentence_ids
from headprune.selection.pruner import Pruner
from headprune.tasks import max_positions


@dataclass
class Setup:
    """What a run needs once every check has passed; nothing of it has written a file yet."""

    module: HeadPruneModule
    datamodule: object
    tokenizer: object
    pruner: Pruner
    pruning: HeadPruning
    baseline_params: dict
    runtime: Runtime = field(default_factory=Runtime)
    evaluation: EvaluationSettings = field(default_factory=EvaluationSettings)
    stages: dict = field(default_factory=dict)  # seconds per stage, for results.json


def assemble(spec: RunSpec, runtime: Runtime | None = None) -> Setup:
    """Data, model (and teacher) loaded and checked against the spec (first of all, the model's
    head against its task); the run's objects built, each given the task. A run without a Trainer
    places the model where `runtime` says (a Trainer places it itself)."""
    runtime = runtime or Runtime()
    task, schedule, recovery = spec.task, spec.schedule, spec.recovery
    L.seed_everything(spec.seed, workers=True)
    tokenizer = load_tokenizer(spec.model.pretrained)
    select = {"select_samples": schedule.selection_samples()} if schedule.selection_samples() else {}
    datamodule = spec.data.load(tokenizer=tokenizer, **select)
    datamodule.setup("fit")
    model = spec.model.build(num_labels=datamodule.num_labels)
    check_model(model, spec)  # its head does model.task, before any work
    set_verify(model, spec.pruning.verify_surgery)  # every prune_heads on it (rounds, the export's fold)
    if not spec.trains:
        runtime.place(model, model_device=spec.pruning.model_device)
    spec.kv_modes.check_model(model, task, spec.budget, spec.layer_policy)
    recovery.check_model(model)
    self_calibration.check_datamodule(datamodule, model, trains=spec.trains or recovery.needs_train_data)
    metric = with_eos_ids(spec.metric, model, tokenizer)
    check_block_size(datamodule, model)
    labels = name_labels(model, datamodule)
    baseline_params = count_params(model)
    module = HeadPruneModule(model, num_labels=datamodule.num_labels, task=task, optimizer=spec.optim.optimizer,
                             scheduler=spec.optim.scheduler, recovery=recovery, **l0_gates(spec.metric))
    if not spec.trains:
        module.head_mask.to(runtime.device)
    results = RunResults(spec.output.output_dir, config=spec.record())
    results.data["runtime"] = runtime.record()
    hybrid = layer_report(model)
    if hybrid:  # the model layers the mask's rows are, and the attention-free layers left alone
        results.data["hybrid_layers"] = hybrid
    if labels:
        results.data["labels"] = labels
    if select:
        results.data["stop_rule_reads"] = (f"selection slice: {select['select_samples']} training examples held out "
                                           "(never the validation set reported in val)")
    pruner = Pruner(model, metric, schedule, spec.layer_policy, spec.budget, recovery, mask=module.head_mask,
                    rearrange=spec.pruning.rearrange, results=results, kv_modes=spec.kv_modes,
                    dense_device=spec.pruning.dense_device, model_device=spec.pruning.model_device, task=task,
                    dense_factory=lambda: runtime.place(spec.model.build(num_labels=datamodule.num_labels)))
    pruning = HeadPruning(pruner, diagnostics=spec.diagnostics.options(), check_consistency=spec.check_consistency,
                          physical=spec.pruning.physical)
    return Setup(module, datamodule, tokenizer, pruner, pruning, baseline_params, runtime, spec.evaluation)


def metric_options(metric) -> dict:
    """The options bound to a metric (a `functools.partial` of a scoring function: what its config
    group sets); none for a bare function."""
    return dict(getattr(metric, "keywords", None) or {})


def with_eos_ids(metric, model, tokenizer):
    """metric=confidence excludes the end-of-sentence token: give it the tokenizer's id ([SEP] for
    BERT, whose config names none) unless metric.eos_token_ids names it."""
    options = metric_options(metric)
    if not options.get("exclude_eos", False) or options.get("eos_token_ids") is not None:
        return metric
    return partial(metric, eos_token_ids=end_of_sentence_ids(model, tokenizer))


def l0_gates(metric) -> dict:
    """HeadPruneModule's L0-gate options: `metric=l0_gates metric.finetune=true` learns the gates
    with the model at `metric.penalty` and `metric.lr`; otherwise none."""
    options = metric_options(metric)
    if not options.get("finetune", False):
        return {}
    return {"l0_penalty": options["penalty"], "l0_lr": options["lr"]}


def name_labels(model, datamodule) -> dict | None:
    """The label mapping of a classification run, put into the model's config (id2label /
    label2id travel with every checkpoint and export) and returned for results.json."""
    label_ids = getattr(datamodule, "label_ids", None)
    if not label_ids:
        return None
    id2label = {i: str(raw) for raw, i in sorted(label_ids.items(), key=lambda kv: kv[1])}
    model.config.id2label = id2label
    model.config.label2id = {raw: i for i, raw in id2label.items()}
    return {"label2id": {raw: i for i, raw in id2label.items()}, "id2label": {str(i): raw for i, raw in id2label.items()}}


def check_block_size(datamodule, model) -> None:
    """A causal-LM block must fit the model's position embeddings."""
    block = getattr(datamodule, "block_size", None)
    positions = max_positions(model.config)
    if block is not None and positions is not None and block > positions:
        raise ValueError(f"data.block_size={block} exceeds the model's {positions} positions; allowed: at most "
                         f"{positions} (or raise the model's n_positions / max_position_embeddings)")
