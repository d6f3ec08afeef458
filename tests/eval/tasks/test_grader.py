"""IFEval's grader (kvlingo/eval/tasks/grader.py): the offline punkt_tab route, and the wrapper's verdicts against
lm-eval called directly."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlingo.eval.tasks import grader


def test_punkt_installed_offline_counts_like_nltk(punkt_home, tmp_path):
    import nltk

    assert punkt_home["path"] == punkt_home["root"] + "/tokenizers/punkt_tab/english"
    prov = grader.ensure_punkt()  # nltk finds the folder we wrote, first on its path
    assert prov["path"] == punkt_home["path"] and prov["sha256"] == punkt_home["sha256"]
    for text, expected, installed, independent in grader.reference_counts():
        assert installed == independent == expected, text
    # the same install again gives byte-identical files: the sha256 in a report names the data
    try:
        assert grader.install_punkt(tmp_path)["sha256"] == punkt_home["sha256"]
    finally:
        nltk.data.path.remove(str(tmp_path.resolve()))


def test_untrained_punkt_is_rejected(punkt_home, tmp_path):
    import nltk
    from nltk.tokenize.punkt import PunktParameters, save_punkt_params

    folder = tmp_path / "tokenizers" / "punkt_tab" / "english"
    folder.parent.mkdir(parents=True)
    nltk.data.path.insert(0, str(tmp_path))
    try:
        save_punkt_params(PunktParameters(), dir=str(folder))
        with pytest.raises(ValueError, match="miscounts sentences"):
            grader.verify_punkt(folder)
    finally:
        nltk.data.path.remove(str(tmp_path))


def test_missing_punkt_is_a_clear_error(monkeypatch, tmp_path):
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with pytest.raises(grader.PunktMissing) as e:
        grader.ensure_punkt()
    assert "punkt_tab" in str(e.value) and "--install-punkt" in str(e.value) and "number_sentences" in str(e.value)


def _doc(ids, kwargs, prompt="Write something."):
    return {"key": 1, "prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}


SENT = "length_constraints:number_sentences"


# (doc, response, strict prompt-level verdict worked out by hand)
CASES = [
    # Punkt keeps "Dr." inside the sentence: 2 sentences (a naive split on ". " says 3).
    (
        _doc([SENT], [{"relation": "less than", "num_sentences": 3, "keywords": None}]),
        "Dr. Smith went home. He was tired.",
        True,
    ),
    (_doc([SENT], [{"relation": "less than", "num_sentences": 3}]), "One. Two. Three. Four.", False),
    (_doc([SENT], [{"relation": "at least", "num_sentences": 3}]), "Mr. Jones came. Dr. Lee left.", False),
    (
        _doc(["change_case:capital_word_frequency"], [{"capital_relation": "less than", "capital_frequency": 2}]),
        "HELLO world, how are you",
        True,
    ),
    (
        _doc(["change_case:capital_word_frequency"], [{"capital_relation": "less than", "capital_frequency": 2}]),
        "HELLO BIG WORLD",
        False,
    ),
    (_doc(["punctuation:no_comma"], [{}]), "no commas here at all", True),
    (_doc(["punctuation:no_comma"], [{}]), "yes, a comma", False),
    (_doc(["length_constraints:number_words"], [{"relation": "at least", "num_words": 5}]), "one two three", False),
    (_doc(["detectable_format:json_format"], [{}]), '{"a": 1}', True),
    (_doc(["detectable_format:json_format"], [{}]), "not json", False),
    (_doc(["keywords:existence"], [{"keywords": ["cat", "mat"]}]), "the cat sat on the mat", True),
    (_doc(["keywords:existence"], [{"keywords": ["cat", "mat"]}]), "the dog sat", False),
    (_doc(["detectable_format:title"], [{}]), "<<A Title>>\nsome text", True),
    # strict fails on the first line; loose drops it and passes
    (_doc(["change_case:english_lowercase"], [{}]), "Sure:\nall lower case text", False),
    (_doc(["punctuation:no_comma", "change_case:english_lowercase"], [{}, {}]), "hello, world", False),
    (_doc(["punctuation:no_comma"], [{}]), "", False),  # an empty answer follows nothing
]


def test_wrapper_verdicts_equal_lm_eval_called_directly(punkt_home):
    from lm_eval.tasks.ifeval import utils  # after the fixture: punkt_tab is there, no download is tried

    grader.check_docs([d for d, _, _ in CASES])
    graded = []
    for doc, response, strict in CASES:
        ours = grader.grade(doc, response)
        direct = utils.process_results(doc, [response])
        assert ours == {k: direct[k] for k in grader.METRICS}, (doc["instruction_id_list"], response)
        assert ours["prompt_level_strict_acc"] is strict, (doc["instruction_id_list"], response)
        graded.append(ours)
    assert graded[13]["prompt_level_loose_acc"] and not graded[13]["prompt_level_strict_acc"]
    assert graded[14]["inst_level_strict_acc"] == [False, True]
    # aggregation: lm-eval's own aggregators give the same means
    agg = grader.aggregate(graded)
    for m in grader.METRICS:
        xs = [g[m] for g in graded]
        ref = utils.agg_inst_level_acc(xs) if m.startswith("inst") else sum(xs) / len(xs)
        assert agg[m]["mean"] == pytest.approx(ref)
    assert agg["inst_level_strict_acc"]["n"] == sum(len(d["instruction_id_list"]) for d, _, _ in CASES)


def test_unknown_instruction_is_refused(punkt_home):
    with pytest.raises(ValueError, match="unknown instruction ids"):
        grader.check_docs([_doc(["keywords:telepathy"], [{}])])


def test_installed_punkt_is_readable_by_others(punkt_home):
    import os

    mask = os.umask(0)
    os.umask(mask)
    files = list(Path(punkt_home["path"]).iterdir())
    assert len(files) == 4 and all(p.stat().st_mode & 0o777 == 0o666 & ~mask for p in files)
