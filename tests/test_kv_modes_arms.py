"""experiments/llm_kv_modes' arms are configs (conf/experiment/llm_kv_modes/<arm>.yaml): each
composes to what the arm's command line composed when it ran (`experiment=llm_kv_modes` plus the
overrides run.sh used to pass, kept here as the record), and every arm run.sh names has a config."""
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from headprune.apps.config_schema import register_schemas
from tests.helpers import compose_train

register_schemas()

ROOT = Path(__file__).resolve().parents[1]
# the overrides each arm ran with before it became a config (run.sh's ARM array at 0b03af8)
RAN_WITH = {
    "attention_mass": ["kv_modes=attention_mass", "kv_modes.removal=any"],
    "attention_mass_85": ["kv_modes=attention_mass", "kv_modes.removal=any", "budget.target=0.15"],
    "attention_mass_last": ["kv_modes=attention_mass", "kv_modes.removal=last"],
    "attention_mass_85_last": ["kv_modes=attention_mass", "kv_modes.removal=last", "budget.target=0.15"],
    "attention_mass_33_last": ["kv_modes=attention_mass", "kv_modes.removal=last", "budget.target=0.67"],
    "measured": ["kv_modes=measured"],
    "removal": ["kv_modes=none"],
    # new since: two calibration blocks (the refit's holdout needs one to choose its damp on)
    "removal_refit": ["kv_modes=none", "layer_policy=attention_drop", "recovery=refit", "data.score_samples=2"],
    "retrieval": ["kv_modes=retrieval"],
    "retrieval_85": ["kv_modes=retrieval", "budget.target=0.15"],
    "retrieval_uniform": ["kv_modes=retrieval", "kv_modes.unit_value=uniform"],
    "retrieval_33": ["kv_modes=retrieval", "budget.target=0.67"],
    "retrieval_2048": ["kv_modes=retrieval", "budget.seq=2048", "data.block_size=2048", "evaluation.perplexity_seqs=[2048]",
                       "evaluation.passkey_lengths=[2048]"],
    "retrieval_33_2048": ["kv_modes=retrieval", "budget.target=0.67", "budget.seq=2048", "data.block_size=2048",
                          "evaluation.perplexity_seqs=[2048]", "evaluation.passkey_lengths=[2048]"],
}


def _plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=False)


@pytest.mark.parametrize("arm", sorted(RAN_WITH))
def test_each_arm_config_composes_what_its_command_line_did(arm):
    as_config = compose_train("/tmp/unused", "/tmp/unused", f"experiment=llm_kv_modes/{arm}")
    as_overrides = compose_train("/tmp/unused", "/tmp/unused", "experiment=llm_kv_modes", *RAN_WITH[arm])
    assert _plain(as_config) == _plain(as_overrides)


def test_every_arm_run_sh_runs_has_a_config():
    lines = (ROOT / "experiments/llm_kv_modes/run.sh").read_text().splitlines()
    named = {arm for line in lines if not line.lstrip().startswith("#")
             for arm in re.findall(r"\bone ([a-z]\w*) (?:true|false)", line)}
    configs = {p.stem for p in (ROOT / "conf/experiment/llm_kv_modes").glob("*.yaml")}
    assert named == configs and configs == set(RAN_WITH), (named - configs, configs ^ set(RAN_WITH))
