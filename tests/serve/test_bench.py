"""The serving benchmark's suspect timing (kvlingo/serve/bench.py), which `make serve-perf` prints: each row's
trials and the state it ran in, the table's ratios, and the allocation suspect's two paths. No vLLM here."""

import os

import pytest
import torch

from kvlingo.serve import bench


def test_run_state_reads_this_processs_threads_cpus_and_inference_mode():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        state = bench.run_state()
        assert state["threads"] == 1 and state["inference_mode"] is False
        with torch.inference_mode():
            assert bench.run_state()["inference_mode"] is True
        assert 1 <= state["affinity"] <= (os.cpu_count() or 1)
        assert state["numa_nodes"] >= 1
    finally:
        torch.set_num_threads(before)


def test_suspects_time_each_call_after_its_warmups_and_keep_every_trial():
    calls = []
    s = bench.Suspects(trials=3, warmups=2)
    row = s.time("here", lambda: calls.append(1))
    assert len(calls) == 5  # two untimed, three timed
    assert row["n"] == 3 and len(row["trials"]) == 3 and row["where"] == "here"
    assert row["min"] <= row["median"] <= row["max"]
    assert row["threads"] == torch.get_num_threads()


def test_the_table_gives_each_median_as_a_multiple_of_the_first_rows_and_the_engines_own_state():
    s = bench.Suspects(trials=2)
    s.add("before", [1.0, 3.0])
    s.add("inside", [4.0, 4.0], threads=7, inference_mode=True)
    lines = s.table().splitlines()
    assert len(lines) == 4
    before, inside = (line.split(" | ") for line in lines[2:])
    assert before[0] == "| before" and before[2] == "2.000" and before[5] == "1.00"
    assert inside[2] == "4.000" and inside[5] == "2.00" and inside[6] == "7" and inside[8] == "yes |"
    assert bench.Suspects(trials=1).table() == ""


def test_first_touch_times_fresh_against_reused_memory_of_the_results_bytes():
    out = bench.first_touch([(4, 16, 2, 8), (3, 5)], torch.bfloat16, trials=2)
    assert out["bytes"] == (4 * 16 * 2 * 8 + 3 * 5) * 2
    assert out["fresh"]["n"] == out["reused"]["n"] == 2
    assert out["cost_s"] == pytest.approx(out["fresh"]["median"] - out["reused"]["median"])


def test_the_random_export_takes_a_variants_settings_and_is_made_again_for_other_settings(tiny_pair_paths, tmp_path):
    """`make serve-perf` times random maps of the default translator: prepare-real exports the pilot profile's l2s
    variant with that variant's own option values (`default_translator`); a variant's values reach the export (the
    window of five, not the family's three), a folder that reads back as the same settings is kept, and one of other
    settings is made again."""
    import json

    from kvlingo.core.families import variant
    from kvlingo.inputs.profiles import get_profile
    from kvlingo.stages.serve_demo import default_translator

    name, family, flags = default_translator()
    fam, v = variant(get_profile("pilot").family_for("l2s"))
    assert (name, family, flags) == (v.name, fam.name, dict(v.flags))
    large, small = tiny_pair_paths
    out = tmp_path / "export"

    def export(**kw):
        bench.random_export(large, small, out, "l2s", "tokeninput", "cache", "float32", refresh="exact:0", **kw)
        return json.loads((out / "config.json").read_text()), (out / "config.json").stat().st_mtime_ns

    wide, made = export(flags=dict(variant("token-w5")[1].flags))
    assert wide["family"] == "tokeninput" and wide["settings"]["window"] == 5
    assert export(flags={"window": 5})[1] == made  # kept: it reads back as these settings
    own, _ = export()
    assert own["settings"]["window"] == 3 and own["settings"]["rank"] == wide["settings"]["rank"]
