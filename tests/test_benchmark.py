"""Benchmark and switch-cost stages on the tiny pair: quality arms, native controls, timing, reports, exit codes."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvlingo.bench import timing
from kvlingo.core.cache import capture
from kvlingo.core.families.headwise.maps import Headwise
from kvlingo.core.fit import NormalEquations
from kvlingo.core.handoff import as_ids, prefill
from kvlingo.core.translator import Geometry
from kvlingo.eval import quality
from kvlingo.eval.controls import native_controls, tolerances_for
from kvlingo.inputs.models import ModelSpec, load_model, load_tokenizer, render_ids
from kvlingo.io import read_json, read_jsonl, sha256_file
from kvlingo.records.saved import save_translator

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "the cat sat on a mat while ada wrote code in the lab remember what was said before yes no Paris Rome blue red"
).split()


# --------------------------------------------------------------------------- tiny data and maps
def conversations(tok, n: int, seed: int) -> list[dict]:
    """Rows in the prepared-split format, with prefixes of varied length (so the control pairing must crop and join)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24)))}]
        prefix = render_ids(tok, msgs, enable_thinking=False)
        reply_text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7))) + "<|im_end|>"
        reply = tok(reply_text, add_special_tokens=False)["input_ids"]
        cid = hashlib.sha256(json.dumps([seed, i, prefix, reply]).encode()).hexdigest()
        rows.append(
            {
                "id": cid,
                "prefix_ids": prefix,
                "reply_ids": reply,
                "prefix_text": tok.decode(prefix),
                "reply_text": reply_text,
                "reasoning": False,
                "source_ids": [str(i)],
            }
        )
    return rows


def write_split(folder: Path, tok, test_rows: list[dict]) -> Path:
    from tinypair import write_prepared

    return write_prepared(folder, tok, {"test": test_rows})


def fit_maps(source, target, convs: list[dict], key_space: str, ridges: tuple[float, ...]) -> list[Headwise]:
    """Closed-form head-wise maps fitted on whole conversations (source features → target features), one per ridge."""
    geometry = Geometry.of(source, target)
    tr = Headwise(geometry, key_space).bind(source, target)
    ne = NormalEquations(*tr.fit_blocks())
    with torch.no_grad():
        for c in convs:
            ids = as_ids(c["prefix_ids"] + c["reply_ids"], "cpu")
            s, t = capture(source, ids), capture(target, ids)
            ne.update(0, tr.design(0, s), tr.space.target_keys(t))
            ne.update(1, tr.design(1, s), t.values)
    out = []
    for ridge in ridges:
        maps = Headwise(geometry, key_space)
        maps.set_solution(*ne.solve(ridge))
        out.append(maps.bind(source, target))
    return out


@pytest.fixture(scope="module")
def setup(tiny_pair_paths, tmp_path_factory):
    """Models (FP32), a test split folder and an artifacts folder with both maps kinds."""
    root = tmp_path_factory.mktemp("bench")
    large_p, small_p = tiny_pair_paths
    tok = load_tokenizer(ModelSpec.parse(str(small_p)))
    large = load_model(ModelSpec.parse(str(large_p)), "cpu", torch.float32)
    small = load_model(ModelSpec.parse(str(small_p)), "cpu", torch.float32)
    test_rows = conversations(tok, 6, seed=1)
    train_rows = conversations(tok, 10, seed=2)
    data = write_split(root / "data" / "tiny", tok, test_rows)
    art = root / "artifacts"
    cf, stand_in = fit_maps(
        large, small, train_rows, "prenorm", (1e-3, 1e-1)
    )  # a second ridge stands in for distilled maps
    save_translator(art / "t" / "closed_form", cf, {"direction": "l2s", "kind": "closed_form"})
    save_translator(art / "t" / "distilled", stand_in, {"direction": "l2s", "kind": "distilled"})
    only_cf = root / "artifacts_cf_only"
    save_translator(only_cf / "t" / "closed_form", cf, {"direction": "l2s", "kind": "closed_form"})
    return {
        "root": root,
        "large": large,
        "small": small,
        "large_p": large_p,
        "small_p": small_p,
        "tok": tok,
        "test": test_rows,
        "data": data,
        "art": art,
        "cf_only": only_cf,
        "cf": cf,
    }


def pair_args(s) -> list[str]:
    return ["--large", str(s["large_p"]), "--small", str(s["small_p"]), "--device", "cpu"]


# --------------------------------------------------------------------------- the control's pairing
def test_control_contexts_come_from_other_conversations():
    convs = [{"id": f"c{i}", "prefix_ids": list(range(100 * i, 100 * i + n))} for i, n in enumerate([5, 12, 8, 30, 9])]
    pairs = quality.control_contexts(convs)
    for conv, p in zip(convs, pairs):
        n = len(conv["prefix_ids"]) - 1
        assert conv["id"] not in p["ids"] and len(p["context_ids"]) == n
        own_tokens = set(conv["prefix_ids"])
        assert not own_tokens & set(p["context_ids"])  # ids are disjoint ranges per conversation here
    assert pairs[0] == {"ids": ["c1"], "kind": "cropped", "context_ids": list(range(100, 104))}
    assert pairs[1]["ids"] == ["c3"]  # c2 (7 tokens of context) is too short for 11; c3 is next long enough
    longest = pairs[3]  # nobody else is as long: the others are joined, in order from the next one
    assert longest["kind"] == "joined" and longest["ids"] == ["c4", "c0", "c1", "c2"]
    assert (
        longest["context_ids"]
        == (list(range(400, 408)) + list(range(0, 4)) + list(range(100, 111)) + list(range(200, 207)))[:29]
    )
    two = quality.control_contexts(convs[:2])  # one short other: it is joined with itself until long enough
    assert two[1] == {"ids": ["c0", "c0", "c0"], "kind": "joined", "context_ids": [0, 1, 2, 3] * 2 + [0, 1, 2]}


# --------------------------------------------------------------------------- quality arms
def test_arms_follow_handoff_split_against_plain_forwards(setup):
    """native_source and no_context NLL vs transformers' plain (cache-free) forward and F.cross_entropy."""
    large, small, conv = setup["large"], setup["small"], setup["test"][0]
    tr = {"closed_form": setup["cf"]}
    other = quality.control_contexts(setup["test"])[0]["context_ids"]
    got = quality.score_conversation(large, small, tr, "closed_form", conv, other, torch.float32)
    assert list(got) == ["native_source", "native_target", "closed_form", "control", "no_context"]
    P, R = conv["prefix_ids"], conv["reply_ids"]
    with torch.no_grad():
        full = large(input_ids=torch.tensor([P + R[:-1]])).logits[0, len(P) - 1 :]  # predicts every reply token
        alone = small(input_ids=torch.tensor([[P[-1]] + R[:-1]])).logits[0]
    ref_src = F.cross_entropy(full, torch.tensor(R), reduction="sum").item()
    ref_none = F.cross_entropy(alone, torch.tensor(R), reduction="sum").item()
    assert got["native_source"]["nll_sum"] == pytest.approx(ref_src, rel=1e-5)
    assert got["no_context"]["nll_sum"] == pytest.approx(ref_none, rel=1e-5)
    assert got["native_target"]["kl_sum"] == 0.0 and got["native_target"]["top1"] == 1.0
    assert all(a["n_tokens"] == len(R) for a in got.values())
    assert got["no_context"]["kl_mean"] > 1e-3  # the prefix matters to the target


def test_planted_perfect_translator_scores_zero_and_control_does_not(setup):
    """Self-translation (target → target, identity maps): its own arm equals native exactly; the control does not."""
    small = setup["small"]
    tr = Headwise.identity(Geometry.of(small, small), "prenorm").bind(small, small)
    convs = setup["test"]
    pairing = quality.control_contexts(convs)
    rows = [
        {
            "arms": quality.score_conversation(
                small, small, {"distilled": tr}, "distilled", c, p["context_ids"], torch.float32
            )
        }
        for c, p in zip(convs, pairing)
    ]
    summary = quality.summarize(rows)["arms"]
    assert summary["distilled"]["kl_token_mean"] == 0.0 and summary["native_source"]["kl_token_mean"] == 0.0
    assert summary["control"]["kl_token_mean"] > 1e-2
    assert summary["control"]["kl_conversation"]["se"] > 0 and summary["control"]["n_conversations"] == len(convs)
    paired = quality.summarize(rows)["paired"]["distilled_vs_control"]  # on NLL, which random models do not order
    assert paired["n"] == len(convs) and math.isfinite(paired["p"])


# --------------------------------------------------------------------------- native controls
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_controls_pass_and_can_fail(setup, dtype):
    model = load_model(ModelSpec.parse(str(setup["small_p"])), "cpu", dtype)
    tol = tolerances_for(dtype)
    for conv in setup["test"][:3]:
        r = native_controls(model, conv["prefix_ids"], conv["reply_ids"], tol)
        assert r["reconstruction"]["passed"] and r["identity"]["passed"], r
        # transformers' own cache and attention: same tensors, same kernels
        shipped = native_controls(model, conv["prefix_ids"], conv["reply_ids"], tol, kind="dynamic")
        assert shipped["reconstruction"]["max_abs_dlogit"] == 0.0
        bad = native_controls(model, conv["prefix_ids"], conv["reply_ids"], tol.scaled(-1.0))
        assert not bad["reconstruction"]["passed"] and not bad["identity"]["passed"]


# --------------------------------------------------------------------------- timing
def test_timing_paths_agree_and_keep_raw_trials(setup):
    large, small = setup["large"], setup["small"]
    ids = as_ids(setup["test"][0]["prefix_ids"], "cpu")
    k = 4
    paths = timing.HandoffPaths(large, small, setup["cf"], ids[:, :-k], ids[:, -k:])
    with torch.inference_mode():
        plain = small(input_ids=ids).logits[0, -1]  # independent reference for the target's own paths
        assert torch.allclose(paths.target_reprefill(), plain, atol=1e-5)
        assert torch.allclose(paths.target_cache_continue(), plain, atol=1e-5)
        assert torch.equal(paths.source_cache_handoff(), paths.source_prefill_handoff())
    with torch.no_grad():  # keeping only the last logits leaves the captured cache unchanged
        ref, lean = capture(large, ids), prefill(large, ids, want_prenorm=True)
    for name in ("keys", "values", "prenorm"):
        assert torch.equal(getattr(ref, name), getattr(lean, name))
    assert torch.allclose(ref.logits[-1:], lean.logits, atol=1e-5)  # one-row vs many-row GEMM rounding
    summaries = timing.time_paths(paths, timing.PATHS, timing.Trials(warmups=1, repeats=4))
    for s in summaries.values():
        assert len(s["trials_s"]) == 4 and all(t > 0 for t in s["trials_s"])
        assert s["median_s"] == statistics.median(s["trials_s"])
        assert s["cv"] == pytest.approx(statistics.stdev(s["trials_s"]) / statistics.mean(s["trials_s"]))
    sp = timing.speedups(summaries)
    assert (
        sp["source_cache_handoff"]
        == summaries["target_reprefill"]["median_s"] / summaries["source_cache_handoff"]["median_s"]
    )
    intervals = timing.speedup_intervals(summaries)
    assert set(intervals) == set(sp) and all(lo <= sp[name] <= hi for name, (lo, hi) in intervals.items())
    br = timing.time_breakdown(paths, timing.Trials(warmups=0, repeats=3))
    assert list(br) == list(timing.STAGES) and all(len(s["trials_s"]) == 3 for s in br.values())
    assert timing.summarize([1.0, 1.0, 1.3], cv_limit=0.1)["noisy"] and not timing.summarize([1.0, 1.01], 0.1)["noisy"]


# --------------------------------------------------------------------------- the stage scripts
def run_script(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_benchmark_script_writes_every_row(setup):
    out = setup["root"] / "results_ok"
    proc = run_script(
        [
            "benchmark.py",
            "--data",
            str(setup["data"]),
            "--run",
            "t",
            "--artifacts",
            str(setup["art"]),
            "--results",
            str(out),
            "--dtype",
            "float32",
            "--timing-repeats",
            "3",
            "--timing-warmups",
            "1",
            "--new-turn-tokens",
            "4",
            "--allow-cv",
            *pair_args(setup),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = out / "t"
    rep = read_json(out / "benchmark.json")
    assert rep["stage"] == "benchmark" and rep["schema_version"] == 3
    res = rep["results"]
    arms = res["quality"]["arms"]
    assert list(arms) == list(quality.ARMS)
    n_tokens = sum(len(c["reply_ids"]) for c in setup["test"])
    for m in arms.values():
        assert m["n_conversations"] == 6 and m["n_tokens"] == n_tokens
        assert m["kl_conversation"]["n"] == 6 and math.isfinite(m["kl_conversation"]["se"])
    assert arms["native_target"]["kl_token_mean"] == 0.0 and arms["native_target"]["nll_delta_vs_native_target"] == 0.0
    # fitted maps carry the conversation: they beat the same maps on another conversation's cache, and the floor
    assert arms["control"]["kl_token_mean"] > arms["closed_form"]["kl_token_mean"]
    assert arms["no_context"]["kl_token_mean"] > arms["closed_form"]["kl_token_mean"]
    assert set(res["quality"]["paired"]) >= {
        "distilled_vs_native_target",
        "closed_form_vs_native_target",
        "distilled_vs_control",
    }
    rows = read_jsonl(out / "benchmark.rows.jsonl")
    assert [r["id"] for r in rows] == [c["id"] for c in setup["test"]]
    assert all(r["id"] not in r["control_pairing"]["ids"] for r in rows)
    for d in ("bfloat16", "float32"):
        c = res["controls"][d]
        assert c["reconstruction"]["passed"] == c["identity"]["passed"] == 6 and c["tolerances"]["dtype"] == d
    t = res["timing"]["contexts"][0]
    assert t["id"] == max(setup["test"], key=lambda c: len(c["prefix_ids"]))["id"]
    assert set(t["paths"]) == set(timing.PATHS) and all(len(s["trials_s"]) == 3 for s in t["paths"].values())
    assert set(t["breakdown"]) == set(timing.STAGES) and set(t["speedup"]) == set(timing.PATHS[1:])
    assert set(t["speedup_interval"]) == set(t["speedup"]) and "95% interval" in proc.stdout
    assert res["checks"]["passed"] and rep["files"]["benchmark.rows.jsonl"] == sha256_file(out / "benchmark.rows.jsonl")
    assert rep["config"]["pair"]["device"] == "cpu" and rep["env"]["threads"] >= 1 and res["timing"]["threads"] >= 1
    assert "| distilled" in (out / "benchmark.md").read_text() and "| distilled" in proc.stdout


def test_finished_report_is_not_redone_unless_inputs_change(setup, monkeypatch, capsys):
    import benchmark

    # other kvlingo modules may change while this runs; pin the code hash so only our inputs vary
    monkeypatch.setattr("kvlingo.records.resume.code_hash", lambda *a: "pinned")
    results = setup["root"] / "results_resume"
    out = results / "t"
    args = [
        "--data",
        str(setup["data"]),
        "--run",
        "t",
        "--artifacts",
        str(setup["art"]),
        "--results",
        str(results),
        "--dtype",
        "float32",
        "--control-dtypes",
        "float32",
        "--limit",
        "2",
        "--timing-conversations",
        "0",
        *pair_args(setup),
    ]
    benchmark.main(args)
    first = read_json(out / "benchmark.json")
    assert first["results"]["timing"] is None and first["n_samples"]["conversations"] == 2
    capsys.readouterr()
    benchmark.main(args)
    assert "up to date" in capsys.readouterr().out
    assert read_json(out / "benchmark.json")["created_unix"] == first["created_unix"]
    benchmark.main(args + ["--limit", "3"])  # a changed config re-runs
    assert read_json(out / "benchmark.json")["n_samples"]["conversations"] == 3


def test_failed_checks_exit_nonzero_after_writing(setup, capsys):
    import benchmark

    out = setup["root"] / "results_fail"
    with pytest.raises(SystemExit) as exc:
        benchmark.main(
            [
                "--data",
                str(setup["data"]),
                "--run",
                "t",
                "--artifacts",
                str(setup["cf_only"]),
                "--results",
                str(out),
                "--dtype",
                "bfloat16",
                "--control-dtypes",
                "bfloat16",
                "--skip-missing",
                "--tolerance-scale",
                "-1",
                "--cv-limit",
                "0",
                "--limit",
                "3",
                "--timing-repeats",
                "2",
                "--timing-warmups",
                "0",
                "--new-turn-tokens",
                "4",
                *pair_args(setup),
            ]
        )
    last = capsys.readouterr().err.splitlines()[-1]  # after the progress bars: one line
    assert exc.value.code == 1 and last.startswith("benchmark: checks failed: "), last
    res = read_json(out / "t" / "benchmark.json")["results"]
    assert not res["checks"]["passed"] and not res["checks"]["controls_passed"] and res["checks"]["noisy_timings"]
    assert any("CV" in f for f in res["checks"]["failed"]) and any(
        "reconstruction" in f for f in res["checks"]["failed"]
    )
    assert "distilled" not in res["quality"]["arms"] and res["quality"]["control_translator"] == "closed_form"
    assert res["quality"]["skipped"] == ["distilled"]
    # a missing artifact without --skip-missing: a clear error before any model is loaded
    capsys.readouterr()
    with pytest.raises(SystemExit) as missing:
        benchmark.main(
            ["--data", str(setup["data"]), "--run", "t", "--artifacts", str(setup["cf_only"]), *pair_args(setup)]
        )
    err = capsys.readouterr().err
    assert missing.value.code == 2 and err.count("\n") == 1 and err.startswith("benchmark: no trained translator"), err
    assert "make train" in err and "--skip-missing" in err
    with pytest.raises(SystemExit) as help_exit:
        benchmark.main(["--help"])
    assert help_exit.value.code == 0 and "examples" in capsys.readouterr().out


def test_switch_cost_names_a_missing_translator_and_suggests_only_one_that_exists(setup, capsys):
    import switch_cost

    base = [
        "--data",
        str(setup["data"]),
        "--run",
        "t",
        "--results",
        str(setup["root"] / "results_missing"),
        *pair_args(setup),
    ]
    distilled_only = setup["root"] / "distilled_only"
    save_translator(distilled_only / "t" / "distilled", setup["cf"], {"direction": "l2s", "kind": "distilled"})
    for artifacts, translator, suggestion in (
        (setup["cf_only"], "distilled", "--translator closed_form"),
        (distilled_only, "closed_form", "--translator distilled"),
        (setup["root"] / "nothing", "closed_form", None),
    ):
        with pytest.raises(SystemExit) as e:
            switch_cost.main([*base, "--artifacts", str(artifacts), "--translator", translator])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("switch_cost: no trained translator"), err
        assert (suggestion in err) if suggestion else ("--translator" not in err), err


def test_switch_cost_script(setup, capsys):
    import switch_cost

    out = setup["root"] / "results_switch"
    split_tokens = sum(len(c["prefix_ids"]) + len(c["reply_ids"]) for c in setup["test"])
    lengths = [40, split_tokens + 20]  # the longest needs the conversations joined twice over
    switch_cost.main(
        [
            "--data",
            str(setup["data"]),
            "--run",
            "t",
            "--artifacts",
            str(setup["art"]),
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
            *pair_args(setup),
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
    stream, chat = switch_cost.join_chat(setup["test"], 10)
    assert stream == (setup["test"][0]["prefix_ids"] + setup["test"][0]["reply_ids"])[:10] and not chat["repeated"]
