"""The recipe's ledger (kvlingo/stages/ledger.py): concurrent writers lose no cell, and a finished cell counts as
done only while every output it recorded holds."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

import pytest

from kvlingo.io import atomic_write_json, read_json, sha256_file
from kvlingo.stages import cells as K
from kvlingo.stages.ledger import Ledger

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


def test_a_ledger_checks_every_output_of_a_finished_cell(tmp_path):
    """The recipe's, the ablation's and the frontier's cells share the ledger: a finished cell counts as done only
    while its report, its declared outputs and the files its report lists all hold what was recorded."""
    from kvlingo.stages.cells import Cell

    report, rows, maps = tmp_path / "benchmark.json", tmp_path / "benchmark.rows.jsonl", tmp_path / "maps.safetensors"
    rows.write_text('{"row": 1}\n')
    maps.write_bytes(b"maps")
    report.write_text(json.dumps({"files": {rows.name: sha256_file(rows)}}))
    cell = Cell("benchmark/a", "benchmark", "benchmark.py", {}, str(report), {}, outputs=(str(maps),))
    ledger = Ledger(tmp_path / "recipe-state.json", {}, resume=False)
    ledger.start(cell.name, {"key": cell.key, "outputs": list(cell.outputs)})
    ledger.finish(cell.name, report, 0.0)
    assert ledger.check(cell) == ("done", "finished with the same key")
    for path, damage in ((maps, b"mapz"), (rows, b'{"row": 2}\n')):
        good = path.read_bytes()
        path.write_bytes(damage)
        assert ledger.check(cell) == ("run", f"its output {path} changed since the cell finished")
        path.unlink()
        assert ledger.check(cell) == ("run", f"its output {path} is missing")
        path.write_bytes(good)
    assert ledger.check(cell)[0] == "done"


def _write_cells(path: str, names: list[str]) -> None:
    ledger = Ledger.attach(path)
    for name in names:
        report = Path(path).parent / "reports" / f"{name}.json"
        atomic_write_json(report, {"cell": name})
        ledger.start(name, {"stage": "train", "key": name, "report": str(report)})
        ledger.finish(name, report, 0.0)


def test_concurrent_ledger_writers_lose_no_cell(tmp_path):
    path = tmp_path / K.LEDGER_FILE
    Ledger(path, {"run": "r"}, resume=False)
    names = [[f"p{w}/c{i}" for i in range(15)] for w in range(4)]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_cells, args=(str(path), n)) for n in names[:3]]
    for p in procs:
        p.start()
    threads = [
        threading.Thread(target=_write_cells, args=(str(path), [f"{n}t" for n in names[3][k::2]])) for k in range(2)
    ]  # and two threads of this process at the same time
    for t in threads:
        t.start()
    for p in procs:
        p.join(60)
    for t in threads:
        t.join(60)
    assert all(p.exitcode == 0 for p in procs)
    cells = read_json(path)["cells"]
    want = {n for group in names[:3] for n in group} | {f"{n}t" for n in names[3]}
    assert set(cells) == want and all(c["status"] == "done" and c["runs"] == 1 for c in cells.values())
