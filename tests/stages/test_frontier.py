"""The refresh frontier end to end on the tiny pair: one trained run, three refresh settings from pure
translation to re-prefill, each scored and costed; the goal's cheapest setting named; a resume reruns nothing;
its refusals at parse time and before any work."""

from __future__ import annotations

import pytest
import torch
from tinypair import task_inputs


@pytest.mark.slow
def test_frontier_runs_from_translation_to_reprefill_and_resumes(tiny_pair_paths, tmp_path, monkeypatch, capsys):
    import frontier
    import train_translator

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    data, eval_root = task_inputs(tmp_path, tiny_pair_paths[0])
    pair = [
        "--profile",
        "tiny",
        "--large",
        str(tiny_pair_paths[0]),
        "--small",
        str(tiny_pair_paths[1]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--artifacts",
        str(tmp_path / "artifacts"),
        "--results",
        str(tmp_path / "results"),
    ]
    # head-wise maps without refresh: the sweep of a translator trained with the exact layer 0 is skipped (below)
    train_translator.main([*pair, "--data", str(data), "--family", "headwise", "--refresh", "none"])
    argv = [
        *pair,
        "--data",
        str(data),
        "--data-root",
        str(eval_root),
        "--skip-tasks",
        "ifeval",
        "--settings",
        "none",
        "layers:50%",
        "tail:100%",
        "--no-timing",
    ]
    rep = frontier.main(argv)
    rows = {r["setting"]: r for r in rep["results"]["rows"]}
    assert list(rows) == ["none", "layers:50%", "tail:100%"]
    assert rows["tail:100%"]["test_kl_token"] < 1e-6  # the target re-reads everything: its own distribution
    assert rows["tail:100%"]["fraction_of_reprefill"] == pytest.approx(1.0, rel=0.05)
    assert rows["none"]["fraction_of_reprefill"] < rows["layers:50%"]["fraction_of_reprefill"] < 1.0
    native = rep["results"]["native"]["gsm8k"]
    for row in rows.values():
        assert row["gsm8k"]["n"] == 4
    assert rows["tail:100%"]["gsm8k"]["mean"] == native["mean"]  # re-prefill answers as the native target does
    # the random tiny target answers no GSM8K item, so there is no accuracy to keep a fraction of: no setting named
    assert native["mean"] == 0 and rep["results"]["cheapest_meeting_goal"] == {"tiny-l2s": None}
    # which layers matter: one sweep row per target layer, scored against pure translation and ranked
    sweep = rep["results"]["layer_sweep"]["tiny-l2s"]
    assert sweep["none_kl_token"] == rows["none"]["test_kl_token"]
    assert [r["layer"] for r in sweep["layers"]] == [0, 1]
    assert sorted(r["rank"] for r in sweep["layers"]) == [1, 2]
    for r in sweep["layers"]:
        assert r["kl_removed"] == pytest.approx((sweep["none_kl_token"] - r["test_kl_token"]) / sweep["none_kl_token"])
    assert max(r["kl_removed"] for r in sweep["layers"]) > 0  # some layer's own K/V beats its translation
    out = tmp_path / "results" / "tiny-l2s"
    md = (out / "frontier.md").read_text()
    assert (out / "frontier.png").read_bytes()[:4] == b"\x89PNG" and "tail:100%" in md and "Which layers matter" in md
    again = frontier.main([*argv, "--resume"])  # every cell finished: read back, nothing rerun
    assert again["results"]["rows"] == rep["results"]["rows"]

    # the real-shape timing is a cell too: timed once, then read back by a resume, never timed again
    from kvlingo.bench import timing

    calls = []

    def fake_timings(cfg, specs, toy_width):
        calls.append(sorted(specs))
        return {
            "tokens": cfg.real_tokens,
            "new_turn_tokens": 16,
            "threads": timing.threads(),
            "dtype": "float32",
            "interleaved": True,
            "reprefill": timing.summarize([4.0, 4.4, 4.2]),
            "handoff": {
                f"tiny-l2s|{s}": timing.summarize([0.1 * (i + 1), 0.1 * (i + 1) + 1 / 3, 0.1 * (i + 1)])
                for i, s in enumerate(cfg.settings)
            },
        }

    monkeypatch.setattr("kvlingo.stages.frontier.real_timings", fake_timings)
    timed_argv = [a for a in argv if a != "--no-timing"] + ["--resume"]
    timed = frontier.main(timed_argv)
    assert calls == [["tiny-l2s"]]
    assert (out / "frontier-timing.json").is_file()
    assert [r["time_trials_s"] for r in timed["results"]["rows"]] == [
        [0.1, 0.1 + 1 / 3, 0.1],
        [0.2, 0.2 + 1 / 3, 0.2],
        [0.1 * 3, 0.1 * 3 + 1 / 3, 0.1 * 3],
    ]
    assert timed["results"]["rows"][0]["speedup"] == 4.2 / 0.1
    resumed = frontier.main(timed_argv)
    assert len(calls) == 1 and resumed["results"]["rows"] == timed["results"]["rows"]  # the same trials, read back
    assert resumed["results"]["timing"] == timed["results"]["timing"]
    torch.set_num_threads(2)  # timings made on one thread do not stand for two: the resume says so
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as refused:
            frontier.main(timed_argv)
    finally:
        torch.set_num_threads(1)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "cell timing/real-shapes was recorded with other inputs" in err, err
    assert "inputs.threads: 1 → 2" in err and len(calls) == 1


def test_an_exact0_translators_frontier_starts_at_exact0_without_the_layer_sweep(tiny_pair_paths, tmp_path, capsys):
    """The default translator is trained with the target's exact layer 0: its frontier's grid starts there (pure
    translation would score it without the layer it was trained beside), and the per-layer sweep, which makes
    one layer native with layer 0 translated, is skipped with a note naming layers.py. Maps trained without a
    refresh keep the grid from pure translation, and the sweep."""
    import train_translator
    from kvlingo.core.refresh import Refresh
    from kvlingo.stages import frontier

    data, _ = task_inputs(tmp_path, tiny_pair_paths[0])
    pair = ["--profile", "tiny", "--large", str(tiny_pair_paths[0]), "--small", str(tiny_pair_paths[1])]
    pair += [
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--artifacts",
        str(tmp_path / "a"),
        "--results",
        str(tmp_path / "r"),
    ]
    for run, flags, grid, sweep in (
        ("default", [], frontier.EXACT0_SETTINGS, False),  # the profile's: token input with exact:0
        ("plain", ["--family", "headwise", "--refresh", "none"], frontier.SETTINGS, True),
    ):
        train_translator.main([*pair, "--run", run, "--data", str(data), "--updates", "1", *flags])
        capsys.readouterr()
        argv = [*pair, "--run", run, "--data", str(data), "--skip-tasks", "ifeval", "gsm8k"]
        stage = frontier.Frontier(frontier.Frontier.parse_args(argv))
        stage.check()
        assert [str(r) for r in stage.args.settings] == [str(Refresh.parse(s)) for s in grid]
        assert stage.args.no_layer_sweep is not sweep
        assert ("layers.py" in capsys.readouterr().out) is not sweep


def test_frontier_report_names_the_timings_the_cv_screen_flagged():
    import frontier

    def summary(cv):
        return {"median_s": 1.0, "cv": cv, "noisy": cv > 0.10}

    t = {"reprefill": summary(0.15), "handoff": {"run|none": summary(0.11), "run|tail:10%": summary(0.02)}}
    note = frontier.cv_note(t)
    assert "flagged 2 of 3 timings: re-prefill 0.15, run|none 0.11." in note and "tail:10%" not in note
    t["reprefill"], t["handoff"]["run|none"] = summary(0.05), summary(0.01)
    assert "every timing passed" in frontier.cv_note(t)
    assert frontier.cv_note({}) == ""  # --no-timing: no times, no screen


def test_frontier_names_the_cheapest_setting_with_its_speed_as_a_ratio():
    from kvlingo.stages.frontier import goal_line

    best = {"setting": "tail:100%", "fraction_of_reprefill": 0.9999, "speedup": 0.92}
    line = goal_line("run", best)
    assert line == "- run: **tail:100%**, 100.0% of re-prefill FLOPs, 0.9× the re-prefill's speed"
    assert "faster" not in line  # a ratio below 1 is slower, not "0.9× faster"
    assert goal_line("run", {**best, "speedup": None}).endswith("100.0% of re-prefill FLOPs")
    assert goal_line("run", None) == "- run: no setting keeps ≥ 95% of both"


def test_frontier_rows_get_each_speedup_with_its_interval():
    import frontier
    from kvlingo.bench import timing

    t = {
        "reprefill": timing.summarize([40.0, 42.0, 44.0]),
        "handoff": {
            "run|none": timing.summarize([5.0, 5.5, 6.0]),
            "run|tail:10%": timing.summarize([15.0, 15.0, 15.0]),
        },
    }
    rows = [{"run": "run", "setting": "none"}, {"run": "run", "setting": "tail:10%"}]
    frontier.add_times(rows, t)
    none, tail = rows
    assert none["speedup"] == 42.0 / 5.5 and none["time_trials_s"] == [5.0, 5.5, 6.0]
    lo, hi = none["speedup_interval"]
    assert 40.0 / 6.0 <= lo < none["speedup"] < hi <= 44.0 / 5.0  # inside the extreme trial ratios
    assert tail["speedup_interval"][0] < tail["speedup"] < tail["speedup_interval"][1]  # only re-prefill varies


def test_frontier_refuses_a_run_without_a_trained_translator_in_one_line(tiny_pair_paths, tmp_path, capsys):
    import frontier

    data, eval_root = task_inputs(tmp_path, tiny_pair_paths[0])
    with pytest.raises(SystemExit) as e:
        frontier.main(
            [
                "--profile",
                "tiny",
                "--large",
                str(tiny_pair_paths[0]),
                "--small",
                str(tiny_pair_paths[1]),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--artifacts",
                str(tmp_path / "artifacts"),
                "--results",
                str(tmp_path / "results"),
                "--data",
                str(data),
                "--data-root",
                str(eval_root),
                "--skip-tasks",
                "ifeval",
                "--no-timing",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("frontier: no trained translator at "), err
    assert "make train RUN=" in err


def test_frontier_refuses_an_unknown_refresh_setting_at_parse_time(capsys):
    import frontier

    assert [str(s) for s in frontier.parse_args(["--settings", "none", "tail:10%"]).settings] == ["none", "tail:10%"]
    with pytest.raises(SystemExit) as e:
        frontier.parse_args(["--settings", "none", "bogus"])
    assert e.value.code == 2 and "argument --settings: refresh 'bogus' is not none" in capsys.readouterr().err


def test_frontier_refuses_an_extra_run_without_a_translator(tiny_pair_paths, tmp_path, capsys):
    """--runs puts other trained runs on the frontier; one that was never trained is named before any work."""
    import frontier

    large, small = tiny_pair_paths
    with pytest.raises(SystemExit) as e:
        frontier.main(
            [
                "--profile",
                "tiny",
                "--large",
                str(large),
                "--small",
                str(small),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--artifacts",
                str(tmp_path / "a"),
                "--results",
                str(tmp_path / "r"),
                "--skip-tasks",
                "ifeval",
                "gsm8k",
                "--no-timing",
                "--no-layer-sweep",
                "--runs",
                "other-family",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("frontier: no trained translator at ") and err.count("\n") == 1, err
