"""The prompt sets of nxl_hooks.eval.tasks, checked against what each task claims, word by word (no model:
tests/real/test_real_model.py checks them against a real tokenizer)."""

import json
import re

import pytest

from nxl_hooks.apps.dataset import load_examples
from nxl_hooks.eval import tasks


def _count(word: str, text: str) -> int:
    return len(re.findall(rf"(?<!\w){re.escape(word)}(?!\w)", text))


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_examples_are_distinct_seeded_and_name_evidence_in_the_text(name):
    examples = tasks.make_task(name, 40, seed=3)
    assert examples == tasks.make_task(name, 40, seed=3) and examples != tasks.make_task(name, 40, seed=4)
    assert len({e["text"] for e in examples}) == 40
    assert [e["id"] for e in examples] == [f"{name}-{i}" for i in range(40)]
    for e in examples:
        assert e["task"] == name and e["label"] == e["target"] != e["foil"]
        assert e["target"].startswith(" ") and e["foil"].startswith(" ") and not e["text"].endswith(" ")
        assert all(_count(word, e["text"]) >= 1 for word in e["evidence"])
        last = e["text"].split()[-1].strip(".,?").lower()
        assert last not in [w.lower() for w in e["evidence"]]  # the evidence is not the prediction position


def test_agreement_verb_agrees_with_the_subject_and_attractors_disagree():
    singular = {s for s, _ in tasks._NOUNS}
    plural = {p for _, p in tasks._NOUNS}
    verbs = dict(tasks._VERBS)  # singular -> plural
    for e in tasks.make_task("agreement", 60, seed=0):
        words = e["text"].split()
        subject = e["evidence"][0]
        assert words[0] == "The" and subject in words[1:3]
        is_plural = subject in plural
        assert (e["target"] in verbs.values()) == is_plural and (verbs.get(e["foil"]) == e["target"] or
                                                               verbs.get(e["target"]) == e["foil"])
        nouns_after = [w for w in words[words.index(subject) + 1:] if w in singular | plural]
        assert nouns_after and all((w in plural) != is_plural for w in nouns_after)


def test_factual_target_is_the_capital_of_the_evidence_country():
    for e in tasks.make_task("factual", 60, seed=0):
        country = e["evidence"][0]
        assert e["target"] == " " + tasks._CAPITALS[country] and e["foil"][1:] in tasks._CAPITALS.values()
        assert e["foil"][1:] != tasks._CAPITALS[country]
        assert re.search(rf"capital (city )?of {country}\b|^{country}'s capital", e["text"])


def test_ioi_the_receiver_occurs_once_and_the_giver_twice():
    for e in tasks.make_task("ioi", 60, seed=0):
        receiver, giver = e["target"][1:], e["foil"][1:]
        assert e["evidence"] == [receiver] and _count(receiver, e["text"]) == 1 and _count(giver, e["text"]) == 2
        assert f"{giver} gave" in e["text"] and e["text"].endswith(" to")


def test_induction_target_follows_the_repeated_prefix_once():
    for e in tasks.make_task("induction", 60, seed=0):
        first, second = e["text"].split(". List: ")
        listed, repeated = first.removeprefix("List: ").split(), second.split()
        assert len(repeated) >= 2 and listed[: len(repeated)] == repeated
        assert e["target"] == " " + listed[len(repeated)] and e["foil"][1:] in listed
        assert e["foil"][1:] not in (listed[len(repeated)], repeated[-1]) and _count(e["target"][1:], e["text"]) == 1


def test_jsonl_reads_back_as_evaluate_examples(tmp_path):
    examples = tasks.make_task("ioi", 3)
    path = tasks.write_jsonl(examples, tmp_path / "ioi.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == examples
    loaded = load_examples(path)
    assert [{k: e[k] for k in ("id", "text", "label", "evidence", "target", "foil")} for e in examples] == loaded


def test_unknown_task_and_too_many_prompts_are_value_errors():
    with pytest.raises(ValueError, match="unknown task 'sst2': choose from agreement, factual, ioi, induction"):
        tasks.make_task("sst2", 3)
    with pytest.raises(ValueError, match="fewer than 100000 distinct prompts"):
        tasks.make_task("factual", 100_000)
