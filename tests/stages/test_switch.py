"""The switch-cost stage on the tiny pair: its report, and a missing translator named with the one that exists."""

from __future__ import annotations

import pytest
from benchworld import pair_args

from kvlingo.io import read_json
from kvlingo.records.saved import save_translator


def test_switch_cost_names_a_missing_translator_and_suggests_only_one_that_exists(bench_setup, capsys):
    import switch_cost

    base = [
        "--data",
        str(bench_setup["data"]),
        "--run",
        "t",
        "--results",
        str(bench_setup["root"] / "results_missing"),
        *pair_args(bench_setup),
    ]
    distilled_only = bench_setup["root"] / "distilled_only"
    save_translator(distilled_only / "t" / "distilled", bench_setup["cf"], {"direction": "l2s", "kind": "distilled"})
    for artifacts, translator, suggestion in (
        (bench_setup["cf_only"], "distilled", "--translator closed_form"),
        (distilled_only, "closed_form", "--translator distilled"),
        (bench_setup["root"] / "nothing", "closed_form", None),
    ):
        with pytest.raises(SystemExit) as e:
            switch_cost.main([*base, "--artifacts", str(artifacts), "--translator", translator])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("switch_cost: no trained translator"), err
        assert (suggestion in err) if suggestion else ("--translator" not in err), err


def test_switch_cost_script(bench_setup, capsys):
    import switch_cost

    out = bench_setup["root"] / "results_switch"
    split_tokens = sum(len(c["prefix_ids"]) + len(c["reply_ids"]) for c in bench_setup["test"])
    lengths = [40, split_tokens + 20]  # the longest needs the conversations joined twice over
    switch_cost.main(
        [
            "--data",
            str(bench_setup["data"]),
            "--run",
            "t",
            "--artifacts",
            str(bench_setup["art"]),
            "--results",
            str(out),
            "--dtype",
            "float32",
            "--lengths",
            *map(str, lengths),
            "--new-turn-tokens",
            "4",
            "--timing-repeats",
            "3",
            "--timing-warmups",
            "1",
            "--allow-cv",
            *pair_args(bench_setup),
        ]
    )
    out = out / "t"
    rep = read_json(out / "switch.json")
    res = rep["results"]
    assert rep["stage"] == "switch_cost" and [p["context_tokens"] for p in res["lengths"]] == lengths
    assert res["chat"]["repeated"] and res["chat"]["passes"] == 2 and res["chat"]["conversations_used"] == 6
    for p in res["lengths"]:
        assert set(p["paths"]) == {"re_reading", "switching"}
        assert all(len(s["trials_s"]) == 3 and s["cv"] >= 0 for s in p["paths"].values())
        assert p["speedup"] == p["paths"]["re_reading"]["median_s"] / p["paths"]["switching"]["median_s"]
        assert p["speedup_interval"][0] <= p["speedup"] <= p["speedup_interval"][1]
    assert (out / "switch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "re_reading" in capsys.readouterr().out and "re_reading" in (md := (out / "switch.md").read_text())
    assert "95% interval" in md
    # the joined chat really is the test conversations in order: its first tokens are the first conversation's
    stream, chat = switch_cost.join_chat(bench_setup["test"], 10)
    assert (
        stream == (bench_setup["test"][0]["prefix_ids"] + bench_setup["test"][0]["reply_ids"])[:10]
        and not chat["repeated"]
    )
