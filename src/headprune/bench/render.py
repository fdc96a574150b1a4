"""What the sections' tables, summaries and plot panels share: the section table (a heading over a
`headprune.report` table, the one table library), the bench's cell formats as report Columns, the
rows a headline number is read from, and the speed-up curves."""
from __future__ import annotations

from headprune.report import Column, column, markdown, text


def largest(rows: list[dict]) -> tuple[int, int]:
    """The (batch, seq) with the most tokens."""
    return max(((r["batch"], r["seq"]) for r in rows), key=lambda bs: (bs[0] * bs[1], bs))


def pruned_half(rows: list[dict], shape: tuple[int, int]) -> dict | None:
    """The row at `shape` of the model with half its heads removed (uniform layout, or exported)."""
    return next((r for r in rows if (r["batch"], r["seq"]) == shape and r["kind"] == "pruned"
                 and r["layout"] in ("uniform", "exported") and r["sparsity"] == 0.5), None)


def met(block: dict) -> str:
    return "met" if block["meets_target"] else "missed"


def title(name: str, rows: list[dict]) -> str:
    return name + (f" ({rows[0]['model']})" if rows[0].get("model") else "")


def table(heading: str, rows: list[dict], columns: list[Column]) -> list[str]:
    """A markdown table (`report.markdown`) under `heading`."""
    return [heading, "", *markdown(columns, rows)]


def fmt(key: str, spec: str, heading: str | None = None) -> Column:
    return column(heading or key, key, spec)


def timed(heading: str, key: str) -> Column:
    """A median [first quartile - third quartile] column, from `key` and its `_spread_ms`."""
    return Column(heading, lambda r: ms(r[key], r[key.removesuffix("_ms") + "_spread_ms"]))


def ratio(heading: str, key: str) -> Column:
    return column(heading, key, ".2f")


def ms(median: float, spread: dict) -> str:
    return f"{median:.2f} [{spread['q1']:.2f}-{spread['q3']:.2f}]"


GRID = [text("variant"), fmt("sparsity", ".2f"), fmt("batch", "d"), fmt("seq", "d")]


def curves(ax, rows: list[dict], key: str, label: str = "", theory: bool = True) -> None:
    """Speed-up `key` against sparsity, one line per variant (through dense at 0), and the FLOP limits."""
    dense = [r for r in rows if r["variant"] == "dense"]
    for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "dense"):
        pts = sorted((r["sparsity"], r[key]) for r in dense + [r for r in rows if r["variant"] == variant])
        ax.plot(*zip(*pts), marker="o", label=f"{label}{variant}")
    if not theory:
        return
    for kinds, style, what in ((("pruned",), "--", "pruned"), (("unstructured_dense",), ":", "unstructured")):
        pts = sorted({(r["sparsity"], r["theoretical_attention_ratio"]) for r in rows
                      if r["kind"] == "dense" or (r["kind"] in kinds and r["layout"] in (None, "uniform", "exported"))})
        if len(pts) > 1:
            ax.plot(*zip(*pts), color="black", ls=style, label=f"theoretical attention (FLOPs, {what})")
