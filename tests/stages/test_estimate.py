"""The estimate stage: the paper budget's figures on an H100, and the assumed throughput."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_paper_budget_estimate_on_h100(capsys):
    """The planned figures the README quotes (estimate.py): real Qwen3 shapes (kvlingo.bench.shapes), no download."""
    import estimate

    one = estimate.main(["--profile", "paper-budget", "--gpu", "H100", "--nproc", "1"])
    eight = estimate.main(["--profile", "paper-budget", "--gpu", "H100", "--nproc", "8"])
    assert one.fits and one.peak_bytes == eight.peak_bytes  # memory per rank does not depend on N
    assert one.conversations_per_rank == 8 and eight.conversations_per_rank == 1
    assert 7.5 < one.seconds_per_update / eight.seconds_per_update < 8.0  # 8× fewer conversations, plus the all-reduce
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        estimate.main(["--profile", "paper-budget", "--gpu", "A10", "--nproc", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("estimate: estimated peak") and err.count("\n") == 1, err
    assert "a profile with shorter caps that fits: pilot" in err


def test_estimate_time_follows_the_assumed_throughput(capsys):
    import estimate

    base = ["--profile", "pilot", "--gpu", "H100"]
    one = estimate.main([*base, "--assume-tflops", "100"])
    two = estimate.main([*base, "--assume-tflops", "200"])
    assert "given (--assume-tflops)" in capsys.readouterr().out
    assert one.peak_bytes == two.peak_bytes and one.seconds_per_update > two.seconds_per_update  # memory does not move


def test_a_mistyped_gpu_is_refused_naming_the_nearest(capsys):
    """`--gpu H1000` once planned with the H100's figures (a substring match); `--gpu h100` was refused."""
    import estimate

    with pytest.raises(SystemExit) as e:
        estimate.main(["--profile", "paper-budget", "--gpu", "H1000"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "(did you mean H100?)" in err, err
    assert estimate.main(["--profile", "paper-budget", "--gpu", "h100"]).device.name == "H100"
