"""The analysis notebook runs against the committed results, so it cannot rot."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a Jupyter kernel executes the notebook: over ~2 s
def test_analysis_notebook_executes():
    import nbformat  # here, not at the top: every pytest-xdist worker imports each test module, ~0.3 s
    from nbclient import NotebookClient

    nb = nbformat.read(REPO / "notebooks" / "analysis.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
