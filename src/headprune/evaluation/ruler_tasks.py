"""RULER's tasks as lm-eval 0.4.13 defines them, for `evaluation.ruler` (the module docstring there
says what is lm-eval's and what is ours): the task table, the settings check (no import, no work),
lm-eval's RULER modules imported on demand, each task's yaml read and RULER's score of a prediction.
Split from ruler.py, which builds the samples, scores a model and writes the tables."""
from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ESSAY_HAYSTACK = "tinyshakespeare_train"  # what replaces lm-eval's Paul Graham essays
FLOOR = 0.2  # a task where dense scores below this is left out of the RULER mean


@dataclass(frozen=True)
class RulerTask:
    """One RULER task: lm-eval's yaml (`yaml`), its generator family and the haystack it uses."""

    yaml: str
    kind: str  # niah | vt | cwe | fwe
    haystack: str  # repeat | needle | tinyshakespeare_train | synthetic | wonderwords


TASKS = {
    "niah_single_1": RulerTask("niah_single_1", "niah", "repeat"),
    "niah_single_2": RulerTask("niah_single_2", "niah", ESSAY_HAYSTACK),
    "niah_single_3": RulerTask("niah_single_3", "niah", ESSAY_HAYSTACK),
    "niah_multikey_1": RulerTask("niah_multikey_1", "niah", ESSAY_HAYSTACK),
    "niah_multikey_2": RulerTask("niah_multikey_2", "niah", "needle"),
    "niah_multikey_3": RulerTask("niah_multikey_3", "niah", "needle"),
    "niah_multivalue": RulerTask("niah_multivalue", "niah", ESSAY_HAYSTACK),
    "niah_multiquery": RulerTask("niah_multiquery", "niah", ESSAY_HAYSTACK),
    "vt": RulerTask("vt", "vt", "synthetic"),
    "cwe": RulerTask("cwe", "cwe", "wonderwords"),
    "fwe": RulerTask("fwe", "fwe", "synthetic"),
}
SAMPLE_KEYS = ("task", "context", "index", "input", "gen_prefix", "outputs", "max_gen_toks")  # write_samples' lines


def check_settings(tasks: Sequence[str], contexts: Sequence[int], samples: int, seed: int,
                   prefix: str = "evaluation.ruler_") -> None:
    """Refuse settings that cannot run, naming the field (`prefix` + tasks, contexts, samples, seed)
    and the allowed values (no import, no work)."""
    tasks = list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or len(set(tasks)) != len(tasks):
        what = f"unknown {unknown}" if unknown else "a task named twice"
        raise ValueError(f"{prefix}tasks={tasks}: {what}; allowed: a list of distinct names from {', '.join(TASKS)} "
                         "([]: no RULER); RULER's qa tasks need the network and are not offered")
    if not tasks:
        return
    if not contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in contexts) \
            or len(set(contexts)) != len(contexts):
        raise ValueError(f"{prefix}contexts={list(contexts)!r}: allowed: a non-empty list of distinct token counts >= 1 "
                         "(e.g. [4096])")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"{prefix}samples={samples!r}: allowed: an integer >= 1 (samples per task and context)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{prefix}seed={seed!r}: allowed: an integer")
    missing = [name for name in ("lm_eval", "nltk", "scipy", "wonderwords") if _spec(name) is None]
    if missing:
        raise ValueError(f"{prefix}tasks={tasks} need the packages {missing}, not installed; allowed: "
                         "pip install -e '.[llm]' (lm-eval, nltk, scipy, wonderwords), or evaluation.ruler_tasks=[]")


def _spec(name: str):
    from importlib.util import find_spec

    return find_spec(name)


# -- lm-eval's RULER modules --------------------------------------------------------------------------
@cache
def lm_eval_module(name: str):
    """lm-eval's RULER module `name` (common_utils, niah_utils, prepare_niah, vt_utils, cwe_utils,
    fwe_utils), imported once, only when a task needs it (prepare_niah builds a list of 6 million
    word pairs at import: ~10 s, ~1 GB at its peak). prepare_niah tries to download nltk's punkt_tab
    at import; that is skipped (no network; the essay splitter is ours, module docstring)."""
    import importlib

    import nltk

    download = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with quiet():
            return importlib.import_module(f"lm_eval.tasks.ruler.{name}")
    finally:
        nltk.download = download


MODULES = {"niah": "niah_utils", "vt": "vt_utils", "cwe": "cwe_utils", "fwe": "fwe_utils"}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """lm-eval's generators print and draw progress bars for every sample: kept out of the run's log."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


@cache
def task_config(task: str) -> dict:
    """The yaml of lm-eval's RULER task `task` with its `include` resolved (`!function` tags read as
    their dotted names): `max_gen_toks`, `target_delimiter`, `gen_prefix`, `process_results`."""
    import yaml

    import lm_eval

    folder = Path(lm_eval.__file__).parent / "tasks" / "ruler"

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))

    def read(name: str) -> dict:
        data = yaml.load((folder / name).read_text(), Loader=Loader)
        base = read(data.pop("include")) if "include" in data else {}
        return {**base, **data}

    data = read(f"{TASKS[task].yaml}.yaml")
    metric = data["process_results"].rsplit(".", 1)[-1]
    if metric not in ("process_results", "process_results_part") or data.get("gen_prefix") != "{{gen_prefix}}":
        raise RuntimeError(f"lm-eval's RULER task {task}: process_results {data['process_results']!r} / gen_prefix "
                           f"{data.get('gen_prefix')!r} are not those this module was written for (lm-eval 0.4.13)")
    return {"lm_eval_task": data["task"], "max_gen_toks": int(data["generation_kwargs"]["max_gen_toks"]),
            "target_delimiter": data.get("target_delimiter", " "),
            "metric": "string_match_all" if metric == "process_results" else "string_match_part"}


def score(task: str, prediction: str, outputs: Sequence[str]) -> float:
    """RULER's score of one prediction against its gold answers, lm-eval's metric for `task`
    (`postprocess_pred` then `string_match_all` / `string_match_part`)."""
    if task not in TASKS:
        raise ValueError(f"score: task {task!r} is not one of {', '.join(TASKS)}")
    if not outputs:
        raise ValueError(f"score: {task} has no gold answers")
    common = lm_eval_module("common_utils")
    metric = getattr(common, task_config(task)["metric"])
    return float(metric(common.postprocess_pred([prediction]), [list(outputs)]))
