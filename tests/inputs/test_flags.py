"""StageParser (kvlingo/inputs/flags.py): a parse error is one line, with no usage block."""

from __future__ import annotations

import pytest


def test_other_parse_errors_are_one_line_too(capsys):
    import train_translator

    with pytest.raises(SystemExit) as e:
        train_translator.parse_args(["--key-space", "sideways"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "usage:" not in err
    assert "argument --key-space: invalid choice: 'sideways'" in err and "--help" in err
    with pytest.raises(SystemExit):
        train_translator.parse_args(["--updates", "10", "stray"])
    assert "unexpected argument 'stray'" in capsys.readouterr().err
