"""Make targets as users type them: the stage's flags reach it through *_ARGS and the pair variables."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The environment a user's shell gives make: free of an outer make's flags and of the variables `make test` takes
# (`make test TEST_JOBS=0` runs this file; make exports TEST_JOBS and its MAKEFLAGS to every make below).
OUTER = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "TEST_JOBS", "TEST_ARGS")
SHELL_ENV = {k: v for k, v in os.environ.items() if k not in OUTER}


def test_make_train_with_an_abbreviated_flag_is_refused_and_writes_nothing(tmp_path):
    """As the issue's user typed it: without the refusal, argparse read `--update 10` as `--updates 10` and
    overwrote the demo's translator."""
    env = {**SHELL_ENV, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
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
        env=SHELL_ENV,
    )
    assert "--large meta-llama/Llama-3.2-3B --small meta-llama/Llama-3.2-1B" in proc.stdout
    assert (
        "--large"
        not in subprocess.run(["make", "-n", "perf"], cwd=ROOT, capture_output=True, text=True, env=SHELL_ENV).stdout
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["ablate", "PROFILE=demo", "PAIR=dep"], "PAIR=dep is not a toy pair: one of toy (4 layers), deep (28 layers)"),
        (["ablate", "PROFILE=demo", "PAIR=mismatched"], "PAIR=mismatched is two pairs"),
        (["task", "TASK=arcc"], "TASK=arcc is not a task: one of arc, gsm8k"),
        (["task", "HANDOFF=promt"], "HANDOFF=promt is not a handoff: one of prompt, trace"),
        (["train", "NPROC=0"], "NPROC=0 is not a count of ranks"),
        (["train", "NPROC=two"], "NPROC=two is not a count of ranks"),
        (["ifeval", "TRANSLATOR=closed"], "TRANSLATOR=closed is not a translator of a run: one of distilled"),
        (["test", "TEST_JOBS=two"], "TEST_JOBS=two is not a count of test workers: auto (one per core), 0"),
    ],
)
def test_a_mistyped_choice_or_count_is_one_line_before_any_target_runs(args, message):
    """Before these checks: PAIR=dep or mismatched ran the 4-layer pair under that pair's run name, TASK=arcc was
    make's "No rule to make target", NPROC=0 torchrun's traceback. `make -n` shows that nothing would run."""
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True, env=SHELL_ENV
    )
    assert out.returncode == 2 and out.stdout == ""
    assert message in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_the_checked_variables_pass_where_they_are_right():
    """The right spellings run (dry): one pair of the mismatched demo with its models named, torchrun with 8 ranks,
    a GSM8K trace handoff, the deep pair's ablation."""
    for args, expect in [
        (
            [
                "ablate",
                "PROFILE=demo",
                "PAIR=mismatched",
                "LARGE=artifacts/toy/large",
                "SMALL=artifacts/toy/mismatched",
            ],
            "--small artifacts/toy/mismatched",
        ),
        (["train", "NPROC=8"], "--nproc-per-node 8 train_translator.py --"),
        (["task", "TASK=gsm8k", "HANDOFF=trace"], "--task gsm8k --handoff trace"),
        (["ablate", "PROFILE=demo", "PAIR=deep"], "--run demo-deep-$d-ablate"),
        (["test", "TEST_JOBS=0"], "OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 0 --dist worksteal"),
        (["test"], "-n auto --dist worksteal"),
    ]:
        out = subprocess.run(
            ["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True, env=SHELL_ENV
        )
        assert out.returncode == 0 and expect in out.stdout, (args, out.stderr)


def test_translator_reaches_the_stages_that_take_one():
    """TRANSLATOR=closed_form is `--translator closed_form` for switch, ifeval, task and export (the commands the
    export's refusals print); the default, distilled, adds no flag, so the stages' own default stands."""
    for target in ("switch", "ifeval", "task", "export"):
        dry = ["make", "-n", "--no-print-directory", target, "PROFILE=demo"]
        chosen = subprocess.run(
            [*dry, "TRANSLATOR=closed_form"], cwd=ROOT, capture_output=True, text=True, env=SHELL_ENV
        )
        plain = subprocess.run(dry, cwd=ROOT, capture_output=True, text=True, env=SHELL_ENV)
        assert chosen.returncode == 0 and plain.returncode == 0, (target, chosen.stderr, plain.stderr)
        stage = {"switch": "switch_cost.py", "task": "task_eval.py"}.get(target, f"{target}.py")
        line = next(x for x in chosen.stdout.splitlines() if stage in x and "--direction" in x)  # not a prepare
        assert line.endswith("--translator closed_form") or "--translator closed_form " in line, line
        assert "--translator" not in plain.stdout, plain.stdout


def test_the_deep_pairs_layers_report_has_a_folder_of_its_own():
    """`make layers PAIR=deep` passes the deep pair's run name, under which the stage names its report folder."""
    dry = ["make", "-n", "--no-print-directory", "layers", "PROFILE=demo"]
    deep = subprocess.run([*dry, "PAIR=deep"], cwd=ROOT, capture_output=True, text=True, env=SHELL_ENV)
    toy = subprocess.run(dry, cwd=ROOT, capture_output=True, text=True, env=SHELL_ENV)
    assert deep.returncode == 0 and toy.returncode == 0, (deep.stderr, toy.stderr)
    line = next(x for x in deep.stdout.splitlines() if "layers.py" in x)
    assert "--run demo-deep-l2s" in line and "--run" not in next(x for x in toy.stdout.splitlines() if "layers.py" in x)
