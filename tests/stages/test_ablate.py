"""The ablation stage end to end on the tiny pair: it runs, resumes, and redoes cells whose maps or rows
changed."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tinypair import pair_flags, task_inputs

import ablate
from kvlingo.io import read_json
from kvlingo.stages import ablation as A

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def tiny_argv(tiny_pair_paths, tmp_path, *rows) -> list[str]:
    """ablate.py on the tiny profile and pair with task data made under tmp_path (GSM8K's 4 items; IFEval left
    out), writing there; `rows`: the flags that pick the rows."""
    data, eval_root = task_inputs(tmp_path, tiny_pair_paths[0])
    return [
        *("--profile", "tiny", "--data", str(data), *pair_flags(tiny_pair_paths)),
        *("--data-root", str(eval_root), "--skip-tasks", "ifeval", *rows),
        *("--artifacts", str(tmp_path / "artifacts"), "--results", str(tmp_path / "results")),
    ]


@pytest.mark.slow
def test_ablate_runs_and_resumes(tiny_pair_paths, tmp_path, monkeypatch):
    import ablate

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    argv = tiny_argv(tiny_pair_paths, tmp_path, "--settings", "headwise-ridge0", "crosshead", "token-w1")
    rep = ablate.main(argv)
    res = rep["results"]
    rows = res["rows"]
    assert [r["name"] for r in rows] == ["headwise-ridge0", "crosshead", "token-w1"]  # in the families' order
    assert res["default"]["setting"] in ("headwise-ridge0", "crosshead", "token-w1") and res["metric"] in A.METRICS
    for r in rows:  # every row on validation; GSM8K's 4 items split into 2 + 2
        assert r["val_gsm8k"]["n"] == 2 and r["params"] > 0 and r["val_kl"] >= 0 and r["val_n"] == 6
    tested = [r["name"] for r in rows if "test_kl" in r]
    assert res["default"]["setting"] in tested and "crosshead" in tested  # the l2s default before is always tested
    assert all(r["test_gsm8k"]["n"] == 2 and r["test_n"] == 4 for r in rows if "test_kl" in r)
    assert rows[2]["refresh"] == "exact:0" and rows[2]["real"]["layer0_flops_per_token"] > 0
    # the default: the cheapest row within noise of the best on the chosen metric and each validation task
    ties = {r["name"]: r["val_tie"] for r in rows}
    assert ties[res["default"]["best"]]["tied"] and ties[res["default"]["best"]]["metric"]["worse_by"] == 0
    tied = [r for r in rows if ties[r["name"]]["tied"]]
    assert res["default"]["setting"] == min(tied, key=lambda r: r["real"]["fraction_of_reprefill"])["name"]
    assert all(t["gsm8k"]["n"] == 2 and "ifeval" not in t for t in ties.values())
    out = tmp_path / "results" / "tiny-l2s-ablate"
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG" and "Default" in (out / "ablation.md").read_text()
    assert (out / "token-w1" / "benchmark-validation.json").is_file()
    again = ablate.main([*argv, "--resume"])  # everything finished: read back, nothing rerun
    assert json.dumps(again["results"]["rows"]) == json.dumps(rows)  # (a share of a 0% native accuracy is NaN)
    assert read_json(out / "recipe-state.json")["cells"]


@pytest.mark.slow
def test_the_longer_budget_trains_the_best_again_and_scores_the_defaults_on_test(tiny_pair_paths, tmp_path):
    """--long-factor 2: the best setting trained again for twice the updates, outside the choice, and scored on test
    beside its setting (one setting: it is the default and the best)."""
    torch.set_num_threads(1)
    argv = tiny_argv(tiny_pair_paths, tmp_path, "--settings", "token-w1", "--long-factor", "2")
    res = ablate.main(argv)["results"]
    rows = {r["name"]: r for r in res["rows"]}
    assert list(rows) == ["token-w1", "token-w1-long"] and res["default"]["setting"] == "token-w1"
    assert [rows[n]["long_budget"] for n in rows] == [False, True] and rows["token-w1-long"]["setting"] == "token-w1"
    out = tmp_path / "results" / "tiny-l2s-ablate"
    updates = [read_json(out / n / "train.json")["config"]["updates"] for n in rows]
    assert updates == [4, 8]  # the tiny profile's 4 updates, then twice that
    for r in rows.values():  # both on the same test split and items
        assert r["test_n"] == 4 and r["test_gsm8k"]["n"] == 2 and r["test_kl"] >= 0
    assert rows["token-w1-long"]["test_kl"] != rows["token-w1"]["test_kl"]
    md = (out / "ablation.md").read_text()
    assert "| token-w1-long " in md and "trained again for 2× the updates" in md


@pytest.mark.slow
def test_every_setting_trains_with_each_seed_and_its_row_is_their_mean(tiny_pair_paths, tmp_path, monkeypatch):
    """--seeds 42 43: each setting trained twice (the default seed in the setting's folder, 43 beside it with
    --seed 43), each scored on validation and, for the claims, on test; the row holds the means and each seed's
    own, the ties carry the seeds' spread, and the report lists them. Where the choice is not the profile's
    default (here: the choice made crosshead, the profile's default token-w1), both are scored on test and paired
    there, averaged over the seeds."""
    from kvlingo.inputs.profiles import Profile

    torch.set_num_threads(1)
    choose = A.choose_default
    monkeypatch.setattr(A, "choose_default", lambda *a: {**choose(*a), "setting": "crosshead"})
    monkeypatch.setattr(Profile, "family_for", lambda self, direction: "token-w1")
    argv = tiny_argv(tiny_pair_paths, tmp_path, "--settings", "crosshead", "token-w1", "--seeds", "42", "43")
    rep = ablate.main(argv)
    res = rep["results"]
    out = tmp_path / "results" / "tiny-l2s-ablate"
    assert rep["config"]["seeds"] == [42, 43] and rep["n_samples"]["training_seeds"] == 2
    for r in res["rows"]:
        seeds = r["seeds"]
        assert [s["seed"] for s in seeds] == [42, 43] and [s["run"] for s in seeds] == [r["name"], f"{r['name']}-s43"]
        assert [read_json(out / s["run"] / "train.json")["config"]["seed"] for s in seeds] == [42, 43]
        assert seeds[0]["val_kl"] != seeds[1]["val_kl"]  # two training runs, not one read twice
        assert r["val_kl"] == pytest.approx((seeds[0]["val_kl"] + seeds[1]["val_kl"]) / 2)
        assert r["val_tie"]["metric"]["seeds"] == 2
        if "test_kl" in r:  # a claim: every seed's translator scored on test
            assert all(s["test_n"] == 4 and s["test_gsm8k"]["n"] == 2 for s in seeds)
            assert r["test_kl"] == pytest.approx((seeds[0]["test_kl"] + seeds[1]["test_kl"]) / 2)
            assert r["test_gsm8k"]["seeds"] == 2
    rows = {r["name"]: r for r in res["rows"]}
    assert all("test_kl" in r for r in rows.values())  # the choice and the profile's default, both claims
    vs = res["default"]["on_test_against_profile_default"]
    assert vs["profile_default"] == "token-w1" and vs["kl_per_token"]["seeds"] == 2
    # worse_by: the chosen row's test KL per token less the profile default's, each the mean over the seeds
    assert vs["kl_per_token"]["worse_by"] == pytest.approx(rows["crosshead"]["test_kl"] - rows["token-w1"]["test_kl"])
    acc = {n: [s["test_gsm8k"]["accuracy"] for s in rows[n]["seeds"]] for n in rows}
    assert vs["gsm8k"]["n"] == 2 and vs["gsm8k"]["worse_by_points"] == pytest.approx(
        100 * (sum(acc["token-w1"]) - sum(acc["crosshead"])) / 2
    )
    assert vs["kl_per_token"]["se"] > 0 and vs["tied"] == (vs["kl_per_token"]["tied"] and vs["gsm8k"]["tied"])
    md = (out / "ablation.md").read_text()
    assert "the mean over 2 training seeds (42, 43)" in md and "Validation: 6 conversations" in md
    assert "On test, crosshead against the profile's default token-w1, paired and averaged over the seeds" in md
    assert re.search(r"\| crosshead +\| 43 +\| " + f"{res['rows'][0]['seeds'][1]['val_kl']:.3g}", md)
    again = ablate.main([*argv, "--resume"])  # every cell read back
    assert json.dumps(again["results"]["rows"]) == json.dumps(res["rows"])


@pytest.mark.slow
def test_a_resume_may_add_and_reorder_rows_and_keeps_the_cells_they_share(tiny_pair_paths, tmp_path, capsys):
    """--resume with another --settings (a row added, the order changed) runs the new row's cells only: every cell
    is keyed by its own setting, seed, inputs and code. Other settings of the run (here --items) are still refused."""
    torch.set_num_threads(1)
    ablate.main(tiny_argv(tiny_pair_paths, tmp_path, "--settings", "crosshead"))
    out = tmp_path / "results" / "tiny-l2s-ablate"
    before = read_json(out / "recipe-state.json")["cells"]
    argv = tiny_argv(tiny_pair_paths, tmp_path, "--settings", "token-w1", "crosshead")
    res = ablate.main([*argv, "--resume"])["results"]
    after = read_json(out / "recipe-state.json")["cells"]
    assert [r["name"] for r in res["rows"]] == ["crosshead", "token-w1"]
    assert {n: after[n]["runs"] for n in before} == {n: e["runs"] for n, e in before.items()}  # read back, not rerun
    assert {n: after[n]["key"] for n in before} == {n: e["key"] for n, e in before.items()}
    assert any("token-w1" in n for n in set(after) - set(before))
    with pytest.raises(SystemExit) as e:
        ablate.main([*argv, "--items", "2", "2", "--resume"])
    assert e.value.code == 2 and "settings changed: items" in capsys.readouterr().err


def test_a_seed_named_twice_is_refused_before_anything_runs(tiny_pair_paths, tmp_path, capsys):
    argv = tiny_argv(tiny_pair_paths, tmp_path, "--settings", "crosshead", "--seeds", "42", "42")
    with pytest.raises(SystemExit) as e:
        ablate.main(argv)
    assert e.value.code == 2 and "--seeds 42 42: name each seed once" in capsys.readouterr().err
    assert not (tmp_path / "results" / "tiny-l2s-ablate").exists()


@pytest.mark.slow
def test_ablate_resume_redoes_cells_whose_maps_or_rows_changed(benchmarked_run, tiny_pair_paths, tmp_path, capsys):
    """Once, one flipped byte in a finished cell's maps.safetensors, or an edited benchmark.rows.jsonl, and
    `ablate.py --resume` skipped every cell."""
    argv = [
        "--profile",
        "tiny",
        "--data",
        str(benchmarked_run["data"]),
        *benchmarked_run["pair"],
        "--skip-tasks",
        "ifeval",
        "gsm8k",
        "--settings",
        "crosshead",
        "--long-factor",
        "0",
        "--artifacts",
        str(tmp_path / "artifacts"),
        "--results",
        str(tmp_path / "results"),
    ]
    first = ablate.main(argv)
    cell = tmp_path / "results" / "tiny-l2s-ablate" / "crosshead"
    maps = tmp_path / "artifacts" / "tiny-l2s-ablate" / "crosshead" / "distilled" / "maps.safetensors"
    rows = cell / "benchmark-validation.rows.jsonl"
    good_maps, good_rows = maps.read_bytes(), rows.read_bytes()
    maps.write_bytes(good_maps[:-1] + bytes([good_maps[-1] ^ 1]))
    lines = good_rows.decode().splitlines(keepends=True)
    rows.write_text(lines[0].replace('"id"', '"id_edited"', 1) + "".join(lines[1:]))
    capsys.readouterr()
    again = ablate.main([*argv, "--resume"])
    out = capsys.readouterr().out
    assert f"train/crosshead/train: queued (its output {maps} changed since the cell finished)" in out, out
    assert (
        f"benchmark/crosshead/benchmark-validation: queued (its output {rows} changed since the cell finished)" in out
    ), out
    assert maps.read_bytes() == good_maps and rows.read_bytes() == good_rows  # made again, as they were
    assert again["results"]["rows"][0]["val_kl"] == first["results"]["rows"][0]["val_kl"]
    capsys.readouterr()
    ablate.main([*argv, "--resume"])
    assert "up to date (finished with the same key" in capsys.readouterr().out


def test_the_rows_come_from_the_flag_else_the_profile_and_an_unknown_one_is_refused_by_where_it_came_from():
    from dataclasses import asdict, replace
    from types import SimpleNamespace

    from kvlingo.core.settings import Geometry
    from kvlingo.errors import Refusal
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.stages.ablate import chosen_settings

    toy = Geometry(4, 2, 32, 4, 2, 32)
    pair = SimpleNamespace(direction="l2s", geometry=asdict(toy))
    scale, demo = get_profile("scale"), get_profile("demo")
    assert chosen_settings(SimpleNamespace(settings=None), scale, pair) == scale.ablate_settings
    assert chosen_settings(SimpleNamespace(settings=["crosshead"]), scale, pair) == ("crosshead",)
    assert chosen_settings(SimpleNamespace(settings=None), demo, pair) == tuple(A.default_settings(demo, "l2s", toy))
    with pytest.raises(Refusal, match="profile scale's ablate_settings: token-w9: no such row"):
        chosen_settings(SimpleNamespace(settings=None), replace(scale, ablate_settings=("token-w9",)), pair)
    with pytest.raises(Refusal, match="--settings token-w9: no such row"):
        chosen_settings(SimpleNamespace(settings=["token-w9"]), scale, pair)
