"""The ablation stage end to end on the tiny pair: cells, the table, the default chosen on validation KL only."""

from __future__ import annotations

import pytest
import torch

from kvlingo.io import read_json
from kvlingo.drive import ablation as A
from tinypair import task_inputs


def test_real_cost_counts_flops_at_the_real_shapes():
    by = {s.name: s for s in A.SETTINGS}
    head = A.real_cost(by["headwise"], "l2s", 64)
    assert abs(head["translate_flops_per_token"] - 14.68e6) < 0.01e6  # 2·2·28·8·128²
    cross = A.real_cost(by["crosshead"], "l2s", 64)
    assert cross["translate_flops_per_token"] == pytest.approx(2 * 2 * 28 * 1024 * 1024)
    keys = A.real_cost(by["crosshead-key-rquarter"], "l2s", 64)
    assert keys["real_settings"] == {"rank": 0, "key_rank": 256}  # a quarter of the toy width → of the real one
    assert keys["translate_flops_per_token"] == pytest.approx(2 * 28 * 256 * 2048 + 2 * 28 * 1024 * 1024)
    low = A.real_cost(by["crosslayer-k4-rhalf"], "l2s", 64)
    assert low["real_settings"]["rank"] == 512  # half the toy width (32 of 64) → half the real width (512 of 1024)
    assert head["fraction_of_reprefill"] < cross["fraction_of_reprefill"] < A.real_cost(by["crosslayer-k4"], "l2s", 64)[
        "fraction_of_reprefill"]
    s2l = A.real_cost(by["crosshead"], "s2l", 64)
    assert s2l["fraction_of_reprefill"] < cross["fraction_of_reprefill"]  # the 1.7B's re-prefill costs more


def test_default_is_chosen_on_validation_kl_within_the_cost_cap():
    rows = [{"name": "cheap", "distilled_val_kl": 0.5, "real": {"fraction_of_reprefill": 0.02}},
            {"name": "good", "distilled_val_kl": 0.3, "real": {"fraction_of_reprefill": 0.08}},
            {"name": "best-but-costly", "distilled_val_kl": 0.1, "real": {"fraction_of_reprefill": 0.4}}]
    assert A.choose_default(rows)["setting"] == "good"
    assert A.choose_default(rows[2:])["setting"] is None


@pytest.mark.slow
def test_ablate_runs_and_resumes(tiny_pair_paths, tmp_path, monkeypatch):
    import ablate

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    data, eval_root = task_inputs(tmp_path, tiny_pair_paths[0])
    argv = ["--profile", "tiny", "--data", str(data), "--large", str(tiny_pair_paths[0]), "--small",
            str(tiny_pair_paths[1]), "--device", "cpu", "--dtype", "float32", "--data-root", str(eval_root),
            "--skip-tasks", "ifeval", "--settings", "headwise", "crosshead", "--long-factor", "2",
            "--artifacts", str(tmp_path / "artifacts"), "--results", str(tmp_path / "results")]
    rep = ablate.main(argv)
    rows = rep["results"]["rows"]
    assert [r["name"] for r in rows][:2] == ["headwise", "crosshead"] and len(rows) == 4  # + the best two, longer
    assert all(r["long_budget"] for r in rows[2:])
    assert rep["results"]["default"]["setting"] in ("headwise", "crosshead")
    out = tmp_path / "results" / "tiny-l2s-ablate"
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG" and "Default" in (out / "ablation.md").read_text()
    for r in rows:
        assert r["gsm8k"]["n"] == 4 and r["params"] > 0 and r["test_kl_token"] >= 0
    again = ablate.main([*argv, "--resume"])  # everything finished: read back, nothing rerun
    assert again["results"]["rows"] == rows
    assert read_json(out / "recipe-state.json")["cells"]
