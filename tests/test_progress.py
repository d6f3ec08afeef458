"""Progress bars in a log: a stage's stderr written to a file gets a bar's first and last line, not every redraw;
on a terminal the bars redraw as tqdm does."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from kvlingo.stages.skeleton import refusals_exit
from tqdm import tqdm
from tqdm.auto import tqdm as auto_tqdm

@refusals_exit("bars")
def main():
    for bar in (tqdm, auto_tqdm):
        with bar(range(200), desc="work") as b:
            for i in b:
                b.set_postfix(loss=str(i))  # once forced a redraw per update
                b.set_description("work")
                time.sleep(0.002)

main()
"""


def test_a_stage_writing_to_a_log_draws_each_bar_twice_not_on_every_update(tmp_path):
    log = tmp_path / "stderr.log"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT))], stderr=f, check=True, timeout=120)
    lines = [x for x in log.read_text().replace("\r", "\n").splitlines() if "work" in x]
    assert len(lines) == 4 and "200/200" in lines[1] and "200/200" in lines[3], lines


def test_quiet_in_logs_leaves_a_terminal_alone(monkeypatch):
    import kvlingo.progress as progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(progress, "_quieted", False)
    assert progress.quiet_in_logs(Terminal()) is False
