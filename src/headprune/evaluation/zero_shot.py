"""Zero-shot accuracy of a causal LM through lm-eval-harness, with chance level beside it.

Why lm-eval: its prompts, choices and log-likelihood scoring are what the papers report, so a
pruned model's numbers are comparable with theirs. The model object is wrapped as is
(`HFLM(pretrained=model, tokenizer=tokenizer)`), so masked and physically pruned models
evaluate without saving them.

Local tasks (`LOCAL_TASKS`) are shipped YAML files in `evaluation/tasks/` over data we have
(`sst2_local`: SST-2 validation, 872 sentences; `last_word_local`: the last word of held-out
passages of Tiny Shakespeare and SST-2, `last_word.py`). Their `data_files` is a placeholder: at run
time the data is converted from `<data_dir>` into a cache folder and the YAML is written there
with the real path (`prepare_local_tasks`), so that folder is a complete lm-eval task folder
(also usable as `lm_eval --include_path <folder>`). Any other name (hellaswag, piqa, arc_easy,
winogrande, boolq, ...) is passed to lm-eval, which needs the network (or a datasets cache)
to fetch its data; when it cannot, the error names the task.

lm-eval is an optional extra (`pip install 'headprune[llm]'`): it is imported inside the
functions. It seeds random / numpy / torch; the caller's generator states are restored.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from headprune.atomic import write_text_atomic
from headprune.data.textdata import label_key, read_table
from headprune.evaluation.last_word import last_word_jsonl


def _sst2_jsonl(data_dir: Path) -> str:
    """SST-2 validation as JSON lines {"sentence", "label" (0 negative, 1 positive)}."""
    path = data_dir / "sst2" / "validation.tsv"
    if not path.is_file():
        raise FileNotFoundError(f"zero_shot task 'sst2_local' needs {path} (data_dir={str(data_dir)!r}); "
                                "allowed: a data_dir holding sst2/validation.tsv (see ../shared/data/README.md)")
    table = read_table(path, "sentence", "label")
    rows = []
    for i, (sentence, label) in enumerate(zip(table.texts, table.labels)):
        if label_key(label) not in ("0", "1"):
            raise ValueError(f"{path} row {i + 2}: label {label!r}; allowed: 0, 1")
        rows.append(json.dumps({"sentence": sentence, "label": int(label_key(label))}))
    return "\n".join(rows) + "\n"


@dataclass(frozen=True)
class LocalTask:
    """A shipped task: its YAML file, the placeholder its `data_files` holds, and how the data
    file is made from the data folder."""

    yaml: str
    placeholder: str
    make_data: Callable[[Path], str]


LOCAL_TASKS = {"sst2_local": LocalTask("sst2_local.yaml", "SST2_LOCAL_JSONL", _sst2_jsonl),
               "last_word_local": LocalTask("last_word_local.yaml", "LAST_WORD_LOCAL_JSONL", last_word_jsonl)}


def task_dir():
    """The shipped task folder (a Traversable: a plain folder in a source or wheel install)."""
    return resources.files("headprune.evaluation") / "tasks"


def default_cache_dir() -> Path:
    """Where prepared local tasks go: $HEADPRUNE_CACHE, else $XDG_CACHE_HOME/headprune, else
    ~/.cache/headprune; then zero_shot/."""
    root = os.environ.get("HEADPRUNE_CACHE")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headprune"
    return Path(root) / "zero_shot"


def _write_if_changed(path: Path, text: str) -> None:
    """Rewrite only on a change: the datasets cache keys a data file by its modification time."""
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        write_text_atomic(path, text)


def prepare_local_tasks(names: Sequence[str], data_dir: str | Path | None = None,
                        cache_dir: str | Path | None = None) -> Path:
    """Write the data and YAML of the local tasks `names` into `cache_dir` and return that
    folder (an lm-eval include path). `data_dir`: the shared data folder (None:
    $HEADPRUNE_DATA_DIR)."""
    unknown = [n for n in names if n not in LOCAL_TASKS]
    if unknown:
        raise ValueError(f"tasks={unknown!r} are not local tasks; allowed: {', '.join(LOCAL_TASKS)}")
    data_dir = data_dir or os.environ.get("HEADPRUNE_DATA_DIR")
    if not data_dir:
        raise ValueError(f"local tasks {list(names)} need data: set data_dir= or HEADPRUNE_DATA_DIR to the shared "
                         "data folder (e.g. ../shared/data)")
    folder = Path(cache_dir or default_cache_dir()).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        task = LOCAL_TASKS[name]
        data_file = folder / f"{name}.jsonl"
        _write_if_changed(data_file, task.make_data(Path(data_dir).expanduser().resolve()))
        template = (task_dir() / task.yaml).read_text(encoding="utf-8")
        if task.placeholder not in template:
            raise ValueError(f"{task.yaml}: data_files placeholder {task.placeholder!r} not found")
        _write_if_changed(folder / task.yaml, template.replace(task.placeholder, json.dumps(str(data_file))))
    return folder


def check_tasks(names: Sequence[str], field: str = "tasks") -> None:
    """Before any work: every name is a local task or a task lm-eval knows (its task index, read
    without the network); with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, an lm-eval task's data
    must load now (from a datasets cache), or the error says it cannot. Local tasks' data: see
    `check_local_data`."""
    names = list(names)
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"{field}={names}: allowed: distinct task names")
    hub = [n for n in names if n not in LOCAL_TASKS]
    if not hub:
        return
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(f"{field}: {hub} are lm-eval tasks, but lm-eval is not installed; allowed: the local tasks "
                         f"({', '.join(LOCAL_TASKS)}), or pip install 'headprune[llm]'")
    known = _named_in_lm_eval_configs(hub)
    for name in hub:
        if name not in known:
            raise ValueError(f"{field}: {name!r} is neither a local task ({', '.join(LOCAL_TASKS)}) nor an lm-eval task "
                             "name (e.g. hellaswag, piqa, arc_easy, winogrande, boolq)")
    if any(os.environ.get(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        manager = task_manager(None, include_defaults=True)
        with _rng_kept():
            for name in hub:
                _load_task(manager, name)


def _named_in_lm_eval_configs(names: Sequence[str]) -> set[str]:
    """The `names` that occur as a whole word in some YAML file of lm-eval's task folder: a task,
    group or tag name always does, so a name that occurs nowhere is no lm-eval task. A text scan
    (about a second), where building lm-eval's TaskManager index parses every file (a minute or
    more on a busy machine)."""
    spec = importlib.util.find_spec("lm_eval")  # its folder, without importing it (seconds)
    patterns = {n: re.compile(rb"(?<![\w-])" + re.escape(n.encode()) + rb"(?![\w-])") for n in names}
    found: set[str] = set()
    for path in (Path(spec.origin).parent / "tasks").rglob("*.yaml"):
        text = path.read_bytes()
        found |= {n for n, pattern in patterns.items() if n not in found and pattern.search(text)}
        if len(found) == len(patterns):
            break
    return found


def check_local_data(names: Sequence[str], data_dir: str | Path | None, field: str = "tasks") -> None:
    """Before any work: the data of the local tasks among `names` can be made from `data_dir`
    (None: $HEADPRUNE_DATA_DIR); nothing is written."""
    local = [n for n in names if n in LOCAL_TASKS]
    data_dir = data_dir or os.environ.get("HEADPRUNE_DATA_DIR")
    if local and not data_dir:
        raise ValueError(f"{field}: the local tasks {local} need data: set data.data_dir or HEADPRUNE_DATA_DIR to the "
                         "shared data folder (e.g. ../shared/data)")
    for name in local:
        LOCAL_TASKS[name].make_data(Path(data_dir).expanduser().resolve())


@contextlib.contextmanager
def _rng_kept():
    """Restore the random, numpy and torch generator states that lm-eval reseeds."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng():
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


_MANAGERS: dict[tuple, object] = {}


def task_manager(include: Path | None, include_defaults: bool):
    """lm-eval's TaskManager over its own tasks (`include_defaults`) and the local task folder
    `include`, built once per process for the same folders and files: building the index of
    lm-eval's tasks parses every one of its YAML files (10-15 s on 2 cores), and a run needs it at
    the start-time check and again for the dense and the pruned model. The index names files; a
    task's YAML is read when it loads, so a rewritten local file is read afresh; a file added to
    or removed from `include` makes a new index."""
    from lm_eval.tasks import TaskManager

    files = tuple(sorted(p.name for p in Path(include).iterdir())) if include else ()
    key = (str(include) if include else None, include_defaults, files)
    if key not in _MANAGERS:
        _MANAGERS[key] = TaskManager(include_path=str(include) if include else None, include_defaults=include_defaults)
    return _MANAGERS[key]


def _load_task(manager, name: str):
    """The lm-eval Task `name` (its dataset fetched now), or an error naming the task."""
    try:
        loaded = manager.load([name])["tasks"]
    except KeyError:
        raise ValueError(f"zero_shot task {name!r} is neither a local task ({', '.join(LOCAL_TASKS)}) nor an "
                         "lm-eval task name (e.g. hellaswag, piqa, arc_easy, winogrande, boolq)") from None
    except Exception as err:  # noqa: BLE001 - any fetch failure; the cause is quoted in the message
        offline = [v for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if os.environ.get(v)]
        hint = f" ({' and '.join(offline)} set)" if offline else ""
        raise RuntimeError(f"zero_shot task {name!r}: lm-eval could not load its data{hint}; it needs the network or a "
                           f"datasets cache. Cause: {type(err).__name__}: {str(err)[:300]}") from None
    if len(loaded) != 1:
        raise ValueError(f"zero_shot task {name!r} is a group of {len(loaded)} tasks ({', '.join(loaded)}); "
                         "allowed: single tasks (list its members)")
    return next(iter(loaded.values()))


def chance_level(task, limit: int | None = None) -> float | None:
    """Mean of 1 / number of choices over the documents evaluated (the first `limit`); None
    for tasks that are not multiple choice."""
    if task.OUTPUT_TYPE != "multiple_choice":
        return None
    docs = list(task.eval_docs)[:limit] if limit is not None else list(task.eval_docs)
    return sum(1.0 / len(task.doc_to_choice(doc)) for doc in docs) / len(docs)


def zero_shot(model: nn.Module, tokenizer, tasks: Sequence[str] = ("sst2_local",),
              data_dir: str | Path | None = None, limit: int | None = None, batch_size: int = 8,
              cache_dir: str | Path | None = None) -> dict[str, dict]:
    """{task: {"acc", "acc_stderr", "chance", "n"}} for each of `tasks` (local tasks and lm-eval
    task names), zero-shot, without a chat template. `limit`: the first `limit` documents of
    each task (None: all). The model is evaluated in eval mode; its training flag and the
    caller's random generator states (which lm-eval and its imports touch) are restored."""
    tasks = list(tasks)
    if not tasks or not all(isinstance(t, str) for t in tasks):
        raise ValueError(f"tasks={tasks!r}: allowed: a non-empty list of task names")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit={limit!r} must be None or an integer >= 1")
    local = [t for t in tasks if t in LOCAL_TASKS]
    include = prepare_local_tasks(local, data_dir, cache_dir) if local else None
    was_training = model.training
    model.eval()
    try:
        with _rng_kept():
            return _evaluate(model, tokenizer, tasks, include, limit, batch_size)
    finally:
        model.train(was_training)


def _evaluate(model: nn.Module, tokenizer, tasks: list[str], include: Path | None, limit: int | None,
              batch_size: int) -> dict[str, dict]:
    """`zero_shot`'s lm-eval run; `include`: the prepared local task folder (None: no local task)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(include, include_defaults=any(t not in LOCAL_TASKS for t in tasks))
    loaded = {name: _load_task(manager, name) for name in tasks}
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=list(loaded.values()), task_manager=manager, limit=limit, log_samples=False)
    results = {}
    for name, task in loaded.items():
        row = out["results"][task.task_name]
        if "acc,none" not in row:
            raise ValueError(f"zero_shot task {name!r} reports no accuracy (metrics: "
                             f"{sorted(k for k in row if k != 'alias')}); allowed: tasks with metric acc")
        results[name] = {"acc": row["acc,none"], "acc_stderr": row.get("acc_stderr,none"),
                         "chance": chance_level(task, limit), "n": out["n-samples"][task.task_name]["effective"]}
    return results
