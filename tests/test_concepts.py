"""The Concepts page and the index name every decision a run makes: each typed group of the config
(a schema in Hydra's ConfigStore, apps/config_schema.py) and data.calibration, with the count the
page states. A decision added to the code without a row on the page fails here."""
import re
from pathlib import Path

from hydra.core.config_store import ConfigStore

from headprune.apps.config_schema import register_schemas

REPO = Path(__file__).resolve().parent.parent
NAMES = {"metric": "metric", "layer_policy": "layer policy", "budget": "budget", "kv_modes": "KV modes",
         "data.calibration": "calibration", "schedule": "schedule", "recovery": "recovery"}
NUMBERS = {5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}


def decisions() -> set[str]:
    """The typed groups (schema/<group>/ or schema/<group>.yaml) but evaluation (what is measured
    after, not a decision of the pruning), data (its one decision: data.calibration) and bench
    (headprune-bench's own settings, bench/config.py, stored in the same ConfigStore once a test
    of it has run)."""
    register_schemas()
    schema = ConfigStore.instance().repo["schema"]
    groups = {name.removesuffix(".yaml") for name in schema} - {"evaluation", "data", "bench"}
    assert "self_calibration.yaml" in schema["data"]  # data.calibration's typed settings
    return groups | {"data.calibration"}


def test_concepts_and_index_name_every_decision():
    wanted = decisions()
    assert set(NAMES) == wanted, wanted ^ set(NAMES)
    concepts = (REPO / "docs" / "concepts.md").read_text()
    assert f"A pruning run is {NUMBERS[len(wanted)]} decisions" in concepts
    rows = dict(re.findall(r"^\| ([\w ]+) \| `([\w.]+)=`", concepts, re.M))
    assert {v: k for k, v in rows.items() if v != "export"} == {g: NAMES[g] for g in wanted}, rows
    index = (REPO / "docs" / "index.md").read_text()
    line = next(line for line in index.splitlines() if line.startswith("| [Concepts]"))
    assert f"the {NUMBERS[len(wanted)]} decisions" in line and all(NAMES[g] in line for g in wanted), line
