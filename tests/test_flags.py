"""Flags that no other test passes, each exercised where it takes effect: the estimate's assumed throughput, the
family flags of a training, the SLURM launch settings of the recipe, perf's timing switches, frontier's extra runs,
the toy world's budget and the data stage's Hub revision and row cap."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_estimate_time_follows_the_assumed_throughput(capsys):
    import estimate

    base = ["--profile", "pilot", "--gpu", "H100"]
    one = estimate.main([*base, "--assume-tflops", "100"])
    two = estimate.main([*base, "--assume-tflops", "200"])
    assert "given (--assume-tflops)" in capsys.readouterr().out
    assert one.peak_bytes == two.peak_bytes and one.seconds_per_update > two.seconds_per_update  # memory does not move


@pytest.mark.parametrize(
    "flags, family, settings",
    [
        (
            ["--family", "crosslayer", "--k", "3", "--rank", "4", "--pairing", "proportional"],
            "crosslayer",
            {"k": 3, "rank": 4, "pairing": "proportional"},
        ),
        (["--family", "crosshead", "--key-rank", "3"], "crosshead", {"rank": 0, "key_rank": 3}),
        (
            ["--family", "residual", "--base", "crosshead", "--rank", "2", "--hidden", "8"],
            "residual",
            {"base": {"family": "crosshead", "settings": {"rank": 2}}, "hidden": 8},
        ),
    ],
)
def test_family_flags_reach_the_translator_a_training_builds(flags, family, settings):
    import train_translator
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.records.saved import build
    from kvlingo.stages.train import family_from_args

    geometry = {
        "source_layers": 4,
        "source_kv_heads": 2,
        "source_head_dim": 8,
        "target_layers": 3,
        "target_kv_heads": 2,
        "target_head_dim": 8,
    }
    args = train_translator.parse_args(flags)
    pair = SimpleNamespace(direction="l2s", geometry=geometry)
    got_family, got = family_from_args(args, get_profile("tiny"), pair)
    assert (got_family, got) == (family, settings)
    spec = build({"family": family, "key_space": "prenorm", "settings": got, "geometry": geometry}).settings()
    maps = spec["base"]["settings"] if family == "residual" else spec
    maps.pop("layers")  # the plan, made from the settings
    assert maps.pop("key_rank") == got.get("key_rank", maps["rank"])  # recorded: the keys' rank, --rank's unless given
    got.pop("key_rank", None)
    assert spec == {**got, **({"init_seed": 0} if family == "residual" else {})}


def test_slurm_flags_reach_the_job_settings(tmp_path):
    import recipe
    from kvlingo.stages.launch import launcher_from_args

    args = recipe.parse_args(
        [
            "--launcher",
            "slurm",
            "--device",
            "cuda",
            "--cpus-per-cell",
            "6",
            "--mem-gb",
            "48",
            "--max-requeues",
            "3",
            "--submitit-cluster",
            "debug",
        ]
    )
    launcher = launcher_from_args(args, tmp_path, say=lambda _m: None)
    s = launcher.settings
    assert (s.cpus_per_cell, s.mem_gb, s.max_requeues) == (6, 48.0, 3)
    assert s.parameters()["cpus_per_task"] == 6 and s.parameters()["mem_gb"] == 48.0


def test_perf_timing_switches_reach_the_report(tmp_path, capsys):
    """--max-repeats caps the extra trials, --defer-values off keeps the values translated, --no-cuda-graphs is
    recorded; --strict-cv fails a CPU run on its CV flags (exit 1) after the report is written."""
    import perf

    argv = [
        "--arch",
        "tiny",
        "--lengths",
        "16",
        "--new-turn-tokens",
        "4",
        "--modes",
        "optimised",
        "--device",
        "cpu",
        "--timing-repeats",
        "2",
        "--timing-warmups",
        "0",
        "--max-repeats",
        "3",
        "--max-seconds",
        "0",
        "--defer-values",
        "off",
        "--no-cuda-graphs",
        "--peak-tflops",
        "1",
        "--peak-gbps",
        "1",
        "--results",
        str(tmp_path),
        "--cv-limit",
        "0",
        "--strict-cv",
    ]
    with pytest.raises(SystemExit) as e:
        perf.main(argv)
    assert e.value.code == 1 and "perf: checks failed: CV > 0" in capsys.readouterr().err
    report = json.loads((tmp_path / "perf" / "perf.json").read_text())
    cfg, row = report["config"], report["results"]["lengths"][0]["modes"]["optimised"]
    assert cfg["max_repeats"] == 3 and cfg["defer_values"] == "off" and cfg["cuda_graphs"] is False
    assert row["deferred_values"] is False and not cfg["allow_cv"]
    assert all(2 <= s["n"] <= 3 for s in row["paths"].values())  # a CV of 0 is never met: the cap ends the trials


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


def test_toy_world_mini_build_takes_its_budget(tmp_path):
    """--minutes-per-model 0: each model trains the budget's floor of steps, and the manifest records the budget."""
    import toy_world

    toy_world.main(["--out", str(tmp_path / "toy"), "--mini", "--minutes-per-model", "0"])
    manifest = json.loads((tmp_path / "toy" / "manifest.json").read_text())
    cfg, models = manifest["config"], manifest["results"]["models"]
    assert cfg["large_minutes"] == cfg["small_minutes"] == 0.0 and manifest["results"]["mini"]
    assert models["large"]["train_steps"] == models["small"]["train_steps"] == cfg["min_steps"]


def test_data_stage_streams_the_revision_and_row_cap_it_is_given(tmp_path, monkeypatch, capsys):
    """--revision names the Hub commit streamed, --max-rows bounds the rows read (the Hub stands in by the toy
    corpus)."""
    import kvlingo.inputs.data as data
    import prepare

    toy = tmp_path / "toy"
    sys.path.insert(0, str(ROOT))
    from kvlingo.toy import train as toytrain

    toytrain.install_pair(toy, log=lambda _msg: None)
    asked = []

    def revision(hub):
        asked.append(hub.revision)
        return "e" * 40

    monkeypatch.setattr(data, "resolve_hub_revision", revision)
    monkeypatch.setattr(data, "hub_rows", lambda hub, commit: data.local_rows(toy / "corpus" / "chats.jsonl"))
    prepare.main(
        [
            "--profile",
            "tiny",
            "--tokenizer",
            str(toy / "small"),
            "--out",
            str(tmp_path / "data"),
            "--revision",
            "a" * 40,
            "--max-rows",
            "30",
        ]
    )
    manifest = json.loads((tmp_path / "data" / "tiny" / "manifest.json").read_text())
    source = manifest["inputs"]["source"]
    assert asked == ["a" * 40] and source["revision_requested"] == "a" * 40 and source["max_rows"] == 30
    assert manifest["results"]["rows"]["read"] == 30
