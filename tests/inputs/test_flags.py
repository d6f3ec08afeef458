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


@pytest.mark.parametrize(
    "argv, near",
    [
        (["--profile", "pliot"], "did you mean 'pilot'?"),
        (["--family", "headwsie"], "did you mean 'headwise'?"),
        (["--profile", "zzz"], None),
    ],
)
def test_a_mistyped_choice_gets_the_nearest_one(argv, near, capsys):
    import train_translator

    with pytest.raises(SystemExit) as e:
        train_translator.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "invalid choice" in err
    assert (near in err) if near else ("did you mean" not in err)


def test_near_choice_leaves_other_messages_alone():
    from kvlingo.inputs.flags import near_choice

    assert near_choice("argument --lr: expected one argument") == "argument --lr: expected one argument"
    got = near_choice("argument --direction: invalid choice: 'l2z' (choose from 'l2s', 's2l')")
    assert got.endswith("; did you mean 'l2s'?")


def test_an_unknown_profile_by_name_gets_the_nearest_one():
    from kvlingo.inputs.profiles import get_profile

    with pytest.raises(ValueError, match=r"unknown profile 'paper-bugdet'.*did you mean 'paper-budget'\?"):
        get_profile("paper-bugdet")
