"""A stand-in for the recipe's stage scripts: writes the outputs and report each would, from its flags.

Used in-process by FakeStages (tests/stages/test_recipe.py), and as a process (symlinked under the real
scripts' names) by tests/stages/test_launch.py, where a training cell counts its updates with a checkpoint after
each, so that a cell killed mid-run and resumed can be told from one that started over. It imports no model
code: a process starts in a fraction of a second.

Results are pure functions of the flags: a validation KL with its minimum at lr 3.16e-4, rates
above 2e-3 diverge, and a test-split decoy that favours 1e-4.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path


def write_json(path: Path, obj) -> None:
    """Atomic, as the real stages write (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def val_kl_of(lr: float, seed: int) -> float:
    """Validation KL with its minimum at 3.16e-4 (step 1 around 1e-4); rates above 2e-3 diverge."""
    return float("nan") if lr > 2e-3 else (math.log10(lr) + 3.5) ** 2 + 1e-3 * (seed - 42)


def decoy_test_kl(lr: float) -> float:
    """A test-split number that favours 1e-4: selection must not follow it."""
    return abs(math.log10(lr) + 4.0)


def flags_of(argv) -> dict[str, list[str]]:
    out, key = {}, None
    for t in argv[1:]:
        if t.startswith("--"):
            key = t
            out[key] = []
        else:
            out[key].append(t)
    return out


def report_path(argv) -> Path:
    f, script = flags_of(argv), Path(argv[0]).name
    stem = {"train_translator.py": "train", "benchmark.py": "benchmark"}.get(
        script, "ifeval-native" if "--native" in f else "ifeval"
    )
    return Path(f["--results"][0]) / f["--run"][0] / f"{stem}.json"


def distil(art: Path, updates: int, resume: bool, step_s: float) -> int | None:
    """Count `updates` with a checkpoint after each; on resume, start from the checkpoint. Returns the
    update resumed from (None when fresh)."""
    ckpt = art / "checkpoints" / "update.json"
    start = json.loads(ckpt.read_text())["update"] if resume and ckpt.is_file() else 0
    write_text(art / "stage.pid", f"{os.getpid()} {os.getppid()}\n")
    for u in range(start, updates):
        time.sleep(step_s)
        write_json(ckpt, {"update": u + 1})
    return start if resume and start else None


def fake_stage(argv, report: Path, step_s: float = 0.0) -> dict:
    f, script = flags_of(argv), Path(argv[0]).name
    run = f["--run"][0]
    started = time.time()
    if script == "train_translator.py":
        art = Path(f["--artifacts"][0]) / run
        write_text(art / "closed_form" / "maps.safetensors", "closed form maps")
        results = {"closed_form_val_kl": 1.0, "distilled_val_kl": None}
        if "--closed-form-only" not in f:
            lr, seed = float(f["--lr"][0]), int(f["--seed"][0])
            resumed = distil(art, int(f["--updates"][0]), "--resume" in f, step_s)
            write_text(art / "distilled" / "maps.safetensors", f"distilled {lr} {seed}")
            results.update(distilled_val_kl=val_kl_of(lr, seed), test_kl=decoy_test_kl(lr), resumed_from_update=resumed)
        rep = {"stage": "train", "results": results}
    elif script == "benchmark.py":
        arms = {
            a: {
                "kl_token_mean": 0.0 if a == "native_target" else 2.0,
                "perplexity": 9.0,
                "top1_agreement": 0.5,
                "nll_delta_vs_native_target": 0.1,
                "kl_conversation": {"mean": 2.0, "se": 0.1, "n": 4},
            }
            for a in ("native_source", "native_target", "no_context")
        }
        if "--skip-missing" not in f:
            seed = int(run.rsplit("-s", 1)[1])
            arms["distilled"] = {**arms["no_context"], "kl_token_mean": 0.1 * (seed - 40)}
        rep = {"stage": "benchmark", "results": {"quality": {"arms": arms}, "timing": None}}
    else:  # ifeval.py
        out, extra = Path(f["--results"][0]) / run, {}
        if "--native" in f:
            paths = {"native_source": 0.4, "native_target": 0.5}
            write_text(out / "ifeval-native.rows.jsonl", "native rows\n")
        else:
            seed = int(run.rsplit("-s", 1)[1])
            paths = {"translated": 0.1 * (seed - 40), "native_target": 0.5}
            extra["donor_rows_seen"] = (out / "ifeval-native.rows.jsonl").is_file()
        summary = {
            p: {
                m: {"mean": v, "se": 0.05, "n": 4}
                for m in (
                    "prompt_level_strict_acc",
                    "prompt_level_loose_acc",
                    "inst_level_strict_acc",
                    "inst_level_loose_acc",
                )
            }
            | {"n_prompts": 4}
            for p, v in paths.items()
        }
        rep = {"stage": "ifeval", "results": {"paths": summary, "comparison": {}}, **extra}
    rep["process"] = {
        "pid": os.getpid(),
        "started_unix": started,
        "ended_unix": time.time(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    write_json(report, rep)
    return rep


if __name__ == "__main__":
    argv = [sys.argv[0], *sys.argv[1:]]
    fail = os.environ.get("FAKE_STAGE_FAIL")  # a run name: that cell's stage fails, as on unreadable data
    if fail and flags_of(argv)["--run"][0].endswith(fail):
        sys.exit(f"{Path(argv[0]).name}: cannot read the data")
    fake_stage(argv, report_path(argv), float(os.environ.get("FAKE_STAGE_STEP_S", "0")))
