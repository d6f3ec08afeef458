"""Make targets as users type them: the stage's flags reach it through *_ARGS and the pair variables."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_train_with_an_abbreviated_flag_is_refused_and_writes_nothing(tmp_path):
    """As the issue's user typed it: without the refusal, argparse read `--update 10` as `--updates 10` and
    overwrote the demo's translator."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    roots = f"--artifacts {tmp_path / 'artifacts'} --results {tmp_path / 'results'}"
    out = subprocess.run(
        ["make", "--no-print-directory", "train", "PROFILE=demo", f"TRAIN_ARGS=--update 10 {roots}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert (
        "train_translator.py: no flag --update (flags are spelled out in full, never abbreviated); "
        "did you mean --updates?"
    ) in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_make_perf_passes_a_named_pair():
    proc = subprocess.run(
        ["make", "-n", "perf", "LARGE=meta-llama/Llama-3.2-3B", "SMALL=meta-llama/Llama-3.2-1B"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert "--large meta-llama/Llama-3.2-3B --small meta-llama/Llama-3.2-1B" in proc.stdout
    assert "--large" not in subprocess.run(["make", "-n", "perf"], cwd=ROOT, capture_output=True, text=True).stdout
