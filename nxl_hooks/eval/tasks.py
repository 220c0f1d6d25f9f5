"""Prompt sets with a known answer, a foil and known evidence, for faithfulness on pretrained causal LMs.

    from nxl_hooks.eval.tasks import make_task, write_jsonl
    examples = make_task("agreement", 40, seed=0)   # [{"text": "The author next to the songs", "target": " is",
                                                    #   "foil": " are", "label": " is", "evidence": ["author"], ...}]
    write_jsonl(examples, "agreement.jsonl")        # then: nxl evaluate MODEL agreement.jsonl --out eval/

Each example is a prompt a causal LM continues: ``target`` is the right next token and ``foil`` a wrong one
(both with the leading space a BPE vocabulary keeps in the token), ``label`` equals ``target`` (so accuracy is
"target scores above foil", BLiMP-style) and ``evidence`` lists the words a faithful attribution should rank
first. Everything is drawn from the templates and word lists below with a seeded generator: no downloads.

- ``agreement``: subject-verb number agreement across one or two prepositional phrases whose nouns
  (attractors) have the other number: "The friend of the doors with the authors" -> " was" over " were";
  evidence: the subject noun.
- ``factual``: factual recall, a country's capital, sometimes after another country (a distractor whose capital
  is the foil): "My friend from Spain told me that the capital of France is" -> " Paris" over " Madrid";
  evidence: the country asked about.
- ``ioi``: indirect object identification (Wang et al., 2022): "When Mary and John went to the store, John gave
  a book to" -> " Mary" over " John"; evidence: the name that occurs once.
- ``induction``: copying from context: "List: apple river tiger candle. List: apple river" -> " tiger" over
  another listed word; evidence: the earlier occurrence of the word to copy.

The words were chosen so that each target and foil is one token with a leading space in common BPE
vocabularies (SmolLM2, GPT-2, Llama); :func:`make_task` does not check a tokenizer: ``nxl evaluate`` says when
a target is not one token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Sequence

from ..records.files import write_text

__all__ = ["TASKS", "make_task", "write_jsonl"]

_NOUNS = [("key", "keys"), ("book", "books"), ("door", "doors"), ("car", "cars"), ("dog", "dogs"), ("cat", "cats"),
          ("bird", "birds"), ("house", "houses"), ("tree", "trees"), ("box", "boxes"), ("letter", "letters"),
          ("picture", "pictures"), ("table", "tables"), ("bottle", "bottles"), ("song", "songs"),
          ("friend", "friends"), ("teacher", "teachers"), ("student", "students"), ("doctor", "doctors"),
          ("painting", "paintings"), ("window", "windows"), ("chair", "chairs"), ("author", "authors")]
_PREPOSITIONS = ["near", "next to", "behind", "on", "by", "of", "beside", "under", "above", "for", "with"]
_ADJECTIVES = ["old", "new", "small", "large", "red", "wooden", "famous", "quiet"]
_VERBS = [(" is", " are"), (" was", " were"), (" has", " have")]  # (singular, plural)

_CAPITALS = {"France": "Paris", "Italy": "Rome", "Japan": "Tokyo", "Germany": "Berlin", "Spain": "Madrid",
             "Russia": "Moscow", "England": "London", "Egypt": "Cairo", "China": "Beijing", "Greece": "Athens",
             "Austria": "Vienna", "Portugal": "Lisbon", "Ireland": "Dublin", "Canada": "Ottawa", "Norway": "Oslo",
             "Sweden": "Stockholm", "Poland": "Warsaw", "Hungary": "Budapest", "Finland": "Helsinki",
             "Denmark": "Copenhagen", "Belgium": "Brussels", "Peru": "Lima", "Cuba": "Havana", "Kenya": "Nairobi"}
_FACTUAL = ["The capital of {c} is", "{c}'s capital city is", "The capital city of {c} is",
            "My friend from {d} told me that the capital of {c} is",
            "After a week in {d}, we flew to the capital of {c}, which is",
            "Question: What is the capital of {c}? Answer: The capital of {c} is"]

_NAMES = ["Mary", "John", "Tom", "Anna", "James", "Sarah", "David", "Emma", "Michael", "Lisa", "Paul", "Kate",
          "Peter", "Alice", "Mark", "Laura", "Daniel", "Susan", "Robert", "Linda", "Alex", "Jack", "Emily", "Chris"]
_PLACES = ["store", "park", "school", "station", "market", "office", "beach", "library", "restaurant", "garden"]
_OBJECTS = ["book", "drink", "ring", "letter", "ball", "bag", "key", "flower", "card", "pen"]
_IOI = ["When {a} and {b} went to the {place}, {giver} gave a {thing} to",
        "After {a} and {b} went to the {place}, {giver} gave a {thing} to",
        "Then, {a} and {b} went to the {place}. {giver} gave a {thing} to",
        "While {a} and {b} were working at the {place}, {giver} gave a {thing} to",
        "Friends {a} and {b} found a {thing} at the {place}. {giver} gave it to"]

_LIST_WORDS = ["apple", "river", "table", "garden", "window", "yellow", "mountain", "pencil", "ocean", "coffee",
               "doctor", "silver", "tiger", "music", "paper", "orange", "rabbit", "candle", "forest", "winter",
               "bridge", "engine", "pocket", "hammer", "violin", "castle"]


def _agreement(rng: random.Random) -> dict[str, Any]:
    plural = rng.random() < 0.5
    subject = rng.choice(_NOUNS)
    phrases = []
    for _ in range(rng.randint(1, 2)):
        attractor = rng.choice([n for n in _NOUNS if n != subject])
        phrases.append(f"{rng.choice(_PREPOSITIONS)} the {attractor[0 if plural else 1]}")  # the other number
    adjective = f"{rng.choice(_ADJECTIVES)} " if rng.random() < 0.5 else ""
    singular, plural_verb = rng.choice(_VERBS)
    text = f"The {adjective}{subject[1 if plural else 0]} " + " ".join(phrases)
    target, foil = (plural_verb, singular) if plural else (singular, plural_verb)
    return {"text": text, "target": target, "foil": foil, "evidence": [subject[1 if plural else 0]]}


def _factual(rng: random.Random) -> dict[str, Any]:
    country, other = rng.sample(sorted(_CAPITALS), 2)
    text = rng.choice(_FACTUAL).format(c=country, d=other)
    return {"text": text, "target": " " + _CAPITALS[country], "foil": " " + _CAPITALS[other], "evidence": [country]}


def _ioi(rng: random.Random) -> dict[str, Any]:
    receiver, giver = rng.sample(_NAMES, 2)
    first, second = (receiver, giver) if rng.random() < 0.5 else (giver, receiver)  # ABB and BAB orders
    template = rng.choice(_IOI)  # drawn before place and object: the prompt sets stay as committed
    text = template.format(a=first, b=second, giver=giver, place=rng.choice(_PLACES), thing=rng.choice(_OBJECTS))
    return {"text": text, "target": " " + receiver, "foil": " " + giver, "evidence": [receiver]}


def _induction(rng: random.Random) -> dict[str, Any]:
    words = rng.sample(_LIST_WORDS, rng.randint(5, 8))
    cue = rng.randint(2, len(words) - 2)  # words[:cue] repeated, words[cue] comes next
    foil = rng.choice([w for i, w in enumerate(words) if i not in (cue, cue - 1)])
    text = f"List: {' '.join(words)}. List: {' '.join(words[:cue])}"
    return {"text": text, "target": " " + words[cue], "foil": " " + foil, "evidence": [words[cue]]}


#: name -> one example drawn from a seeded generator.
TASKS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "agreement": _agreement, "factual": _factual, "ioi": _ioi, "induction": _induction}


def make_task(name: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct examples of task ``name`` (see the module docstring), the same for the same seed.

    Keys: id, task, text, target, foil, label (= target), evidence (a list of words of ``text``).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose from {', '.join(TASKS)}")
    rng = random.Random(f"{name}:{seed}")
    out: dict[str, dict[str, Any]] = {}
    misses = 0  # draws in a row that gave a prompt already drawn: the templates are running out
    while len(out) < n and misses < 10_000:
        example = TASKS[name](rng)
        misses = misses + 1 if example["text"] in out else 0
        out.setdefault(example["text"], example)
    if len(out) < n:
        raise ValueError(f"task {name!r} has fewer than {n} distinct prompts; ask for fewer")
    return [{"id": f"{name}-{i}", "task": name, **ex, "label": ex["target"]} for i, ex in enumerate(out.values())]


def write_jsonl(examples: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """One JSON object per line, the format ``nxl evaluate`` reads.

    ``write_jsonl(make_task("ioi", 20), "ioi.jsonl")``
    """
    return write_text(path, "".join(json.dumps(example) + "\n" for example in examples))  # whole or not at all
