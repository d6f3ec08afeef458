"""Stages run as resumable cells (kvlingo/stages/cells.py): the cell key, a cell computed in process recorded
and read back, the driver's cache kind, and Ctrl-C inside a cell."""

from __future__ import annotations

import pytest

import recipe
from kvlingo.io import read_json, sha256_file
from kvlingo.stages import cells as K


def test_ctrl_c_inside_an_in_process_cell_stops_the_driver_not_only_the_cell(tmp_path, capsys, monkeypatch):
    """ablate and frontier run their cells' stages in this process: a cell's Ctrl-C passes to the driver, which
    ends in its own one line and status 130 (not a failed cell while the rest of its level runs on); another
    failure of a cell stays that cell's."""
    from kvlingo.stages import registry
    from kvlingo.stages.launch import StageFailed
    from kvlingo.stages.skeleton import INTERRUPTED_STATUS, Stage, refusals_exit

    for name, error in (("stage_ctrl_c", KeyboardInterrupt), ("stage_fails", SystemExit)):

        def run(self, error=error):
            raise error(1) if error is SystemExit else error()

        stage = type(
            name, (Stage,), {"name": name, "script": f"{name}.py", "common": False, "resumable": True, "run": run}
        )
        monkeypatch.setitem(registry.STAGES, name, registry.Entry(stage, None))
    ran = []

    @refusals_exit("driver", resumable=True)
    def driver(cells):
        for cell in cells:
            try:
                K.run_in_process([str(tmp_path / f"{cell}.py")], tmp_path / "report.json")
            except StageFailed as e:
                ran.append(f"failed: {e}")
        ran.append("level done")

    driver(["stage_fails"])  # a failing cell: recorded, and the level goes on
    assert ran == ["failed: stage_fails.py exited with 1", "level done"]
    ran.clear()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        driver(["stage_ctrl_c", "stage_fails"])
    err = capsys.readouterr().err
    assert e.value.code == INTERRUPTED_STATUS and ran == []  # stopped at the interrupt: no further cell ran
    assert err.count("\n") == 1 and err.startswith("driver: interrupted; every file it wrote is whole"), err


def test_a_cell_computed_here_is_recorded_read_back_on_resume_and_refused_under_other_inputs(tmp_path):
    from kvlingo.records.resume import ResumeRefused

    report = tmp_path / "res" / "timing.json"
    cell = K.Cell("timing/x", "timing", "frontier.py", {"--real-tokens": 64}, str(report), {"threads": 1})
    calls = []

    def compute():
        calls.append(1)
        return {"median_s": 0.1 + 0.2, "trials_s": [0.1, 1 / 3]}  # floats that JSON must carry exactly

    def cells(resume: bool) -> K.Cells:
        return K.Cells(K.Ledger(tmp_path / "res" / "state.json", {"run": "x"}, resume), resume, say=lambda _m: None)

    first = cells(False).ensure_here(cell, compute)
    assert calls == [1] and first == compute() and first == read_json(report)
    entry = read_json(tmp_path / "res" / "state.json")["cells"]["timing/x"]
    assert entry["status"] == "done" and entry["report_sha256"] == sha256_file(report)
    calls.clear()
    resumed = cells(True)
    assert resumed.ensure_here(cell, compute) == first and calls == []  # read back, not computed again
    assert resumed.log == [{"cell": "timing/x", "action": "skipped (finished)"}]

    with pytest.raises(ResumeRefused, match=r"cell timing/x .*inputs\.threads: 1 → 2"):
        cells(True).ensure_here(K.Cell(**{**cell.__dict__, "inputs": {"threads": 2}}), compute)

    def killed():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # killed while computing: marked failed, the old report kept
        cells(False).ensure_here(cell, killed)
    entry = read_json(tmp_path / "res" / "state.json")["cells"]["timing/x"]
    assert entry["status"] == "failed" and "KeyboardInterrupt" in entry["error"] and read_json(report) == first
    assert cells(True).ensure_here(cell, compute) == first and calls == [1]  # the resume computes it again


def test_cell_key_covers_flags_and_inputs_but_not_the_hook():
    base = K.Cell(
        "train/x",
        "train",
        "train_translator.py",
        {"--lr": "0.0001", "--closed-form-only": False},
        "r.json",
        {"data": {"manifest_sha256": "a" * 64}},
        resume_flag="--resume",
    )
    assert base.argv(resume=False) == ["train_translator.py", "--lr", "0.0001"]
    assert base.argv(resume=True)[-1] == "--resume"
    for other in (
        K.Cell(**{**base.__dict__, "flags": {"--lr": "0.000316"}}),
        K.Cell(**{**base.__dict__, "inputs": {"data": {"manifest_sha256": "b" * 64}}}),
        K.Cell(**{**base.__dict__, "extra": ("--batch", "2")}),
    ):
        assert other.key != base.key
    assert K.Cell(**{**base.__dict__, "before": lambda: None}).key == base.key


def test_cells_run_on_the_cache_kind_their_driver_was_given():
    """--cache is a field of the pair config, not a process setting: every cell's stage gets the driver's."""
    from kvlingo.inputs.models import PairConfig

    pair = PairConfig("L", "S", "l2s", "cpu", "float32", {}, {}, "t", "c", {}, cache="dynamic")
    flags = K.stage_flags("tiny", pair, "art", "res")
    assert flags["--cache"] == "dynamic" and flags["--large"] == "L" and flags["--results"] == "res"
    assert (
        recipe.parse_args(["--cache", "dynamic"]).cache == "dynamic" and recipe.parse_args([]).cache == "preallocated"
    )


def test_data_hash_of_an_empty_folder_names_the_run_s_profile(tmp_path):
    """Once, the hint named a profile after the folder (`make prepare PROFILE=data`), which is none."""
    with pytest.raises(ValueError) as e:
        K.data_hash(tmp_path / "data", "tiny")
    msg = str(e.value)
    assert f"prepare.py --profile tiny --out {tmp_path / 'data'}`" in msg and "PROFILE=data" not in msg, msg
    assert f"then pass --data {tmp_path / 'data' / 'tiny'}" in msg, msg
