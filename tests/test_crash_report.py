"""The crash campaign's accounting of trials that never started (its time limit came first):
skipped, reported per store and fault, and no part of the exit status. No campaign runs here."""

from __future__ import annotations

import json
from types import SimpleNamespace

from crashtests import campaign, checker
from crashtests.checker import Trial


def _trial(i, store, fault, *, skipped=False, acked=(), recovered=None, reasons=()):
    t = Trial(id=i, store=store, fault=fault, run=f"r{i}", url="u", acked=list(acked), recovered=recovered,
              reasons=list(reasons), skipped=skipped)
    if skipped:
        t.reasons.append("not started: campaign time limit (5 s)")
    return t


def _report(trials, time_limit=5.0):
    for t in trials:
        checker.classify(t)
    c = SimpleNamespace(trials=trials, cfg=campaign.Config(time_limit=time_limit, chart=False), notes=[])
    return campaign.report(c, wall=6.0)


def _ran_and_skipped():
    """file/kill: 2 ok, 1 skipped; sqlite/corrupt: 1 ok, 2 skipped; dist: nothing ran."""
    return [_trial(1, "file", "kill", acked=[2], recovered=2),
            _trial(2, "file", "kill", acked=[2, 4], recovered=4),
            _trial(3, "file", "kill", skipped=True),
            _trial(4, "sqlite", "corrupt", acked=[2], recovered=2),
            _trial(5, "sqlite", "corrupt", skipped=True),
            _trial(6, "sqlite", "corrupt", skipped=True),
            _trial(7, "file", "dist", skipped=True),
            _trial(8, "sqlite", "dist", skipped=True)]


def test_skipped_trials_are_counted_apart_and_do_not_fail(tmp_path):
    rep = _report(_ran_and_skipped())
    rows = {(r["store"], r["fault"]): r for r in rep["rows"]}
    assert (rows["file", "kill"]["trials"], rows["file", "kill"]["skipped"], rows["file", "kill"]["ok"]) == (2, 1, 2)
    assert (rows["sqlite", "corrupt"]["trials"], rows["sqlite", "corrupt"]["skipped"]) == (1, 2)
    assert (rows["file", "dist"]["trials"], rows["file", "dist"]["skipped"], rows["file", "dist"]["error"]) == (0, 1, 0)
    t = rep["totals"]
    assert (t["trials"], t["skipped"], t["ok"], t["error"], t["lost"], t["corrupt"]) == (3, 5, 3, 0, 0, 0)
    assert rep["skipped"]["total"] == 5 and rep["skipped"]["faults_not_run"] == ["dist"]
    assert {(r["store"], r["fault"], r["skipped"]) for r in rep["skipped"]["rows"]} == {
        ("file", "kill", 1), ("sqlite", "corrupt", 2), ("file", "dist", 1), ("sqlite", "dist", 1)}
    assert rep["failures"] == []
    assert campaign.exit_code(rep) == 0

    md = campaign.markdown(rep)
    assert "| store | fault | state | trials | skipped |" in md
    assert "| file | kill | small | 2 | 1 |" in md
    assert "**skipped**: 5 trials not started" in md and "file/kill 1" in md and "sqlite/corrupt 2" in md
    assert "**WARNING: no `dist` trial ran** (all 2 skipped by the time limit)" in md
    assert "`kill` trial ran" not in md

    paths = campaign.write_report(rep, str(tmp_path / "out"))
    saved = json.loads(open(paths["json"]).read())
    assert saved["skipped"]["total"] == 5 and saved["totals"]["skipped"] == 5
    assert sum(tr["outcome"] == "skipped" for tr in saved["trials"]) == 5


def test_large_trials_have_rows_of_their_own():
    """A campaign of the large profile reported with a small one: a row per profile, marked."""
    small = _trial(1, "file", "kill", acked=[2], recovered=2)
    large = [_trial(2, "file", "kill", acked=[2], recovered=2), _trial(3, "file", "kill", skipped=True),
             _trial(4, "file", "kill", acked=[4], recovered=2)]
    for t in large:
        t.profile = "large"
    rep = _report([small, *large])
    rows = {(r["store"], r["fault"], r["profile"]): r for r in rep["rows"]}
    assert [(r["profile"], r["trials"]) for r in rep["rows"]] == [("small", 1), ("large", 2)]
    assert (rows["file", "kill", "large"]["lost"], rows["file", "kill", "large"]["skipped"]) == (1, 1)
    md = campaign.markdown(rep)
    assert "| file | kill | small | 1 | 0 |" in md and "| file | kill | large | 2 | 1 |" in md
    assert "file/kill (large) 1" in md and "trial 4 (file/kill (large)," in md


def test_exit_status_depends_only_on_trials_that_ran():
    lost = _trial(9, "file", "kill", acked=[4], recovered=2)          # acknowledged step 4 not recovered
    assert campaign.exit_code(_report(_ran_and_skipped() + [lost])) == 1
    broken = _trial(9, "file", "stale", recovered="raised", reasons=["harness error: OSError: x"])
    rep = _report(_ran_and_skipped() + [broken])
    assert campaign.exit_code(rep) == 2 and rep["totals"]["error"] == 1 and rep["totals"]["skipped"] == 5
    assert campaign.exit_code(_report([_trial(1, "file", "kill", skipped=True)])) == 0
    clean = _report([_trial(1, "file", "kill", acked=[2], recovered=2)])
    assert clean["skipped"]["total"] == 0 and "**skipped**" not in campaign.markdown(clean)


def test_pool_and_skip_rest_mark_trials_not_started_as_skipped():
    """The two ways the fault kinds record a trial that the time limit stops: a queued trial
    that the pool does not start, and the remaining trials of a sequential loop."""
    c = campaign.Campaign(campaign.Config(time_limit=0.0, quiet=True))
    try:
        ran = []
        queued = [(c.new_trial("file", "kill", "k", "u"),) for _ in range(3)]
        c.pool(ran.append, queued)
        assert ran == [] and all(t.skipped and not t.reasons[1:] for (t,) in queued)
        c.skip_rest("sqlite", "powerloss", 2)
        resumed = [(Trial(id=99, store="file", fault="kill", run="x", url="u"),)]
        c.pool(ran.append, resumed, trials=False)      # a resume not started: left unchecked
        assert ran == [] and not resumed[0][0].skipped and resumed[0][0].resume is None
    finally:
        c.cleanup()
    assert [checker.classify(t) for t in c.trials] == ["skipped"] * 5
    assert [(t.store, t.fault) for t in c.trials[3:]] == [("sqlite", "powerloss")] * 2


def test_the_chart_is_a_legible_grid_with_the_lost_cell_red(tmp_path):
    """A row per store, a column per fault kind that ran, a cell per (store, fault): the cell
    of the lost trial red, the others green, a store without a fault's trials blank; the
    picture 900-2000 pixels wide at its natural size."""
    import matplotlib.image

    from crashtests import report
    trials, i = [], 0
    for store in ("file", "sqlite"):
        for fault in ("kill", "failpoint", "powerloss", "corrupt"):
            if (store, fault) == ("sqlite", "powerloss"):      # power loss runs on the file store only
                continue
            for k in range(3):
                i += 1
                trials.append(_trial(i, store, fault, acked=[2, 4], recovered=4))
                trials[-1].reached = k > 0
    lost = _trial(99, "sqlite", "corrupt", acked=[2, 4], recovered=2)  # acknowledged step 4 not recovered
    lost.reached = True
    rep = _report(trials + [lost])
    rep["config"]["chart"] = True
    paths = campaign.write_report(rep, str(tmp_path / "out"))
    assert paths["png"].endswith(".png") and (tmp_path / "out" / "crash_report.png").stat().st_size > 0

    g = report.grid(rep)
    assert g["labels"] == ["file", "sqlite"] and g["faults"] == ["kill", "failpoint", "powerloss", "corrupt"]
    assert ("sqlite", "powerloss") not in g["cells"]
    assert g["cells"]["file", "kill"]["lines"] == ["3 trials", "2 hit"]
    assert g["cells"]["sqlite", "corrupt"]["lines"] == ["4 trials", "3 hit", "1 lost"]
    assert [k for k, c in g["cells"].items() if c["state"] == "bad"] == [("sqlite", "corrupt")]

    pixels = matplotlib.image.imread(paths["png"])
    height, width = pixels.shape[:2]
    assert (width, height) == g["size"] and 900 <= width <= 2000 and 300 <= height <= 1500

    def colour(box):
        x0, y0, x1, y1 = box
        r, gr, b = pixels[y0 + 4, (x0 + x1) // 2][:3]     # inside the cell, above its text
        return "red" if r > 0.7 and gr < 0.35 and b < 0.35 else "green" if gr > r and gr > b else "other"

    assert colour(g["cells"]["sqlite", "corrupt"]["box"]) == "red"
    assert all(colour(c["box"]) == "green" for k, c in g["cells"].items() if k != ("sqlite", "corrupt"))
    x0, y0, x1, y1 = g["cells"]["file", "powerloss"]["box"]
    blank = (x0, y0 + (y1 - y0), x1, y1 + (y1 - y0))                 # the cell below it: sqlite has no powerloss
    assert colour(blank) == "other"
