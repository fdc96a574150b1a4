"""Re-render bench.md and bench.png next to each given bench.json with the current report code
(the json, rows and summary, is read, never rewritten): for runs written before a change to how
the bench renders them (here: the llm panel of bench.png and the two-sided target wording).
Usage: python experiments/llm_kv/decode/rerender.py experiments/llm_kv/decode/*/bench.json"""
import json
import sys
from pathlib import Path

from headprune.bench.report import markdown, plot

for path in map(Path, sys.argv[1:]):
    results = json.loads(path.read_text())
    (path.parent / "bench.md").write_text(markdown(results))
    plot(results, path.parent / "bench.png")
    print(f"re-rendered {path.parent}/bench.md and bench.png")
