"""The GPU check: the GPU tests, perf at 4k/8k/16k tokens in both directions and the toy benchmark on one CUDA GPU,
in one call and one table (OUT/gpu-check.md). What each step does, and every flag: kvlingo/stages/gpu_check.py
(`GpuCheck`); on a CPU, `--dry-run` runs the same steps on the 2-layer stand-in (tests/stages/test_gpu_check.py).

It runs with plain `python3` and the packages beside it (no .venv): torch with CUDA, transformers as
pinned in pyproject.toml, tokenizers, safetensors, numpy, tqdm, matplotlib and pytest; it names
whatever is missing or too old before running anything (exit 2).

On the GPU machine (torch 2.11 + CUDA 13, transformers 5.17, no network), prepared here on the CPU:

    pip download --no-deps -d .whl transformers==5.24.0     # the pinned transformers, as a wheel
    make toy && make prepare train PROFILE=demo              # artifacts/toy, data/demo, artifacts/demo-l2s

then one device call (the script straight away: `make gpu-check PY=python3` does the same into
results/gpu-check, but make would read $OUT as its own variable):

    run(command="python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
                "export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 && python3 gpu_check.py --out $OUT/gpu-check",
        carry=[".whl", "artifacts/toy", "data/demo", "artifacts/demo-l2s", "results/demo-l2s"], timeout_s=540)

and the table is $OUT/gpu-check/gpu-check.md. The steps' caps add up to more than the budget; the
budget (460 s by default) keeps the whole call inside the timeout with a minute to spare.

    python3 gpu_check.py --help
    .venv/bin/python gpu_check.py --dry-run --out /tmp/gc      (on the CPU)
"""

import sys

from kvlingo.stages.gpu_check import GpuCheck

main = GpuCheck.main
parse_args = GpuCheck.parse_args
build_parser = GpuCheck.parser

if __name__ == "__main__":
    sys.exit(main())
