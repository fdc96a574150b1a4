"""experiments/retraining_free, issue 30's rows (bias compensation, the output-projection refit,
refit-error ranking, refit then KL; the 4k-sentence model at 30% of the attention FLOPs): the
committed tables and targets are what collect.py makes of the committed result files, and the
targets say hit or miss by the right margin."""
import json

from tests.helpers import EXPERIMENTS, experiment_script

EXP = EXPERIMENTS / "retraining_free"
SHARES = ("0.5", "0.6", "0.7", "0.8")
# the committed issue-30 runs: (arm, budget)
RUN = {("fisher_ls_rerun", f"heads {s}") for s in SHARES}
RUN |= {(arm, "flops4k 0.3") for arm in ("fisher", "fisher_ls", "fisher_refit", "refit_rank_refit", "fisher_refit_kl",
                                         "fisher_bc")}
RUN |= {("fisher_refit", f"heads {s}") for s in SHARES}
RUN |= {(arm, f"heads {s}") for arm in ("refit_rank_refit", "fisher_refit_kl", "fisher_bc") for s in SHARES}


def _collect():
    return experiment_script("retraining_free/collect")


def test_refit_rows_are_issue_30s_runs_with_their_conditions():
    collect = _collect()
    table = collect.all_rows(EXP)
    new = {(r["arm"], r["budget"]) for r in table if r["arm"] not in collect.ARMS or r["budget"].split()[0] != "heads"}
    new -= {r for r in new if r[0] in collect.ARMS and r[1].startswith("latency")}
    assert new == RUN  # issue 30's runs, and (c') beside them
    # the repairs after Fisher + rearrangement remove (b)'s heads: same model, same scores, same choice
    for path in sorted((EXP / "results" / "refit").glob("fisher_*.json")):
        arm, budget = collect.budget_of(path.stem)
        if arm == "fisher":
            continue
        none = EXP / "results" / ("" if budget.startswith("heads ") else "refit") / f"fisher_{budget.replace(' ', '_')}.json"
        heads = [json.loads(p.read_text())["rounds"][0]["pruned"] for p in (path, none)]
        assert sorted(map(tuple, heads[0])) == sorted(map(tuple, heads[1])), path.name
    # every issue-30 run recorded its conditions
    assert all(r["commit"] and r["threads"] == "1" for r in table if r["arm"] != "fisher_ls_rerun" and (r["arm"], r["budget"]) in RUN)


def _row(budget, arm, acc, unpruned=0.9):
    return {"budget": budget, "arm": arm, "acc": acc, "acc_unpruned": unpruned, "kl_steps": 100}


def test_targets_say_hit_or_miss_by_how_much():
    collect = _collect()
    table = []
    for s, none, refit in (("0.5", 0.88, 0.89), ("0.7", 0.85, 0.891), ("0.8", 0.80, 0.799)):
        table += [_row(f"heads {s}", "fisher", none), _row(f"heads {s}", "fisher_refit", refit)]
    table += [_row("flops4k 0.3", "fisher", 0.80, 0.85), _row("flops4k 0.3", "fisher_refit", 0.812, 0.85),
              _row("flops4k 0.3", "refit_rank_refit", 0.805, 0.85)]
    lines = collect.targets(table).splitlines()[2:]
    assert len(lines) == 3 + 2  # and the two arms not run on the full model, said so
    beats, rank, kl, seventy, flops = lines
    assert "| not run | not measured |" in rank and "| not run | not measured |" in kl
    assert "(e) (b) + output-projection refit beats no tuning" in beats
    assert "80%: 79.90 vs 80.00 (-0.10)" in beats and beats.endswith("| miss: smallest margin -0.10 points |")
    assert "best (e) (b) + output-projection refit: 89.10, 0.90 below 90.00 | hit by 0.10 points |" in seventy
    table4k = [dict(r, budget=r["budget"].replace("heads ", "heads4k ")) for r in table if r["budget"].startswith("heads ")]
    lines4k = collect.targets(table4k).splitlines()[2:]
    assert len(lines4k) == 2 and "the 4k-sentence model (stand-in)" in lines4k[0] and "not run" not in lines4k[0]
    assert "81.20 vs (b) 80.00 (+1.20) | hit by 0.20 points |" in flops
    table[-2]["acc"] = 0.809  # +0.9: short of the point
    assert collect.targets(table).splitlines()[-1].endswith("(+0.90) | miss by 0.10 points |")
