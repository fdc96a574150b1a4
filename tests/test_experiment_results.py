"""The committed experiment tables are what each experiment's collect.py renders of its committed raw
files (`render(folder) -> {file: text}`, built with headprune.report), byte for byte, so a table
cannot drift from the runs behind it; and the READMEs and the site quote those tables as rendered.
One parametrized test per experiment; headprune.report itself is tested on synthetic runs
(tests/test_report.py), each script's own arithmetic in tests/test_experiment_tables.py."""
import pytest

from headprune.report import stale
from tests.helpers import EXPERIMENTS, REPO, experiment_script

# experiment -> the files its collect.py renders
RENDERED = {
    "decoder_kv": {"results.md", "decoder_kv.csv"},
    "iterative_vs_one_shot": {"results.md", "iterative_vs_one_shot.csv"},
    "recovery": {"results.md", "recovery.csv", "curves.md"},
    "retraining_free": {"results.md", "targets.md", "retraining_free.csv", "beside.md", "summary.md", "streaming_ls.md"},
    "llm_calibration": {"results.md", "best.md"},
    "llm_iterative": {"results.md", "answers.md", "last_word.md", "kl_speed.md"},
    "llm_kv": {"results.md", "summary.md", "answers.md", "llm_kv.csv", "recoveries.md", "heldout.md", "layers/layers.md",
               "last_word/table.md", "other_corpus/table.md"},
    "layer_sensitivity": {"curves.md", "results.md", "profile.md"},
    "metric_curves": {f"{policy}/{name}" for policy in ("global", "uniform") for name in ("curves.md", "results.md")},
    "quickstart": {"rounds.md", "physical_timing.md"},
    "llm_kv_modes": {"results.md", "answers.md"},
    "llm_uneven": {"results.md", "targets.md", "summary.md", "answers.md", "llm_uneven.csv"},
    "scale/model_device": {"results.md"},
    "peers_kvpress": {"results.md"},
}
# experiment -> {page that quotes tables (relative to the repo): the rendered files it quotes}
QUOTED = {
    "recovery": {"experiments/recovery/README.md": ["results.md"]},
    "llm_calibration": {"experiments/llm_calibration/README.md": ["results.md", "best.md"]},
    "retraining_free": {"experiments/retraining_free/README.md": ["results.md", "beside.md", "targets.md"],
                        "docs/guide_budgets.md": ["summary.md"]},
    "llm_kv": {"experiments/llm_kv/README.md": ["results.md", "recoveries.md", "summary.md", "heldout.md"],
               "docs/guide_llms.md": ["summary.md"], "experiments/llm_kv/last_word/README.md": ["last_word/table.md"],
               "experiments/llm_kv/other_corpus/README.md": ["other_corpus/table.md"]},
    "quickstart": {"experiments/quickstart/README.md": ["rounds.md", "physical_timing.md"]},
    "llm_uneven": {"experiments/llm_uneven/README.md": ["results.md", "targets.md"],
                   "docs/guide_uneven_gguf.md": ["summary.md"]},
    "scale/model_device": {"experiments/scale/model_device/README.md": ["results.md"]},
}


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_committed_tables_are_what_collect_renders_of_the_raw_files(name):
    files = experiment_script(f"{name}/collect").render(EXPERIMENTS / name)
    assert set(files) == RENDERED[name]
    assert stale(EXPERIMENTS / name, files) == [], f"run python experiments/{name}/collect.py"
    for page, quoted in QUOTED.get(name, {}).items():
        for file in quoted:
            assert files[file] in (REPO / page).read_text(), (page, file)


def test_the_layer_granularity_table_is_its_raw_files():
    """experiments/llm_kv_modes/README.md's "Layer granularity" table is layer_table.py's output
    from results/<arm>.json, every arm it names run."""
    lines, missing = experiment_script("llm_kv_modes/layer_table").table()
    assert not missing
    readme = (EXPERIMENTS / "llm_kv_modes" / "README.md").read_text()
    assert "\n".join(lines) in readme
