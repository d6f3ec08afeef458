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


@pytest.mark.parametrize(
    "flag, value, why",
    [
        ("--lr", "-1e-3", "give a finite number > 0"),
        ("--lr", "nan", "give a finite number > 0"),
        ("--weight-decay", "-0.1", "give a finite number ≥ 0"),
        ("--max-grad-norm", "inf", "give a finite number ≥ 0"),
        ("--batch", "0", "give a whole number ≥ 1"),
        ("--updates", "-1", "give a whole number ≥ 0"),
        ("--val-every", "2.5", "not a whole number"),
    ],
)
def test_a_training_number_out_of_range_is_refused_when_parsed(flag, value, why, capsys):
    """A negative rate parses as a number and is refused by its own range, before any model or data is read."""
    import train_translator

    with pytest.raises(SystemExit) as e:
        train_translator.parse_args([flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"argument {flag}: " in err and why in err, err
