"""The demo task: neutral filler words with exactly one sentiment keyword; the keyword is the evidence.

    from nxl_hooks.demo.task import make_examples
    ex = make_examples(3, seed=1)[0]   # Example(text="the plot was superb ...", label=1, evidence="superb", ...)

The label is the keyword's sentiment (0 = negative, 1 = positive), so the keyword is the only token that
carries the answer: a faithful attribution ranks it first. With ``neutral > 0`` that share of sentences has
no keyword and label 2 ("neutral"); the shipped demo model is trained with them, so that words which carry
no sentiment read as neutral rather than as a default class. Deterministic for a given seed; used by
``examples/train_demo.py`` to train the shipped model and by ``nxl demo`` to pick held-out sentences.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Example", "FILLER", "LABELS", "MAX_WORDS", "MIN_WORDS", "NEGATIVE", "NEUTRAL", "POSITIVE", "SPECIAL_TOKENS",
           "make_examples", "vocabulary"]

LABELS = ("negative", "positive", "neutral")  #: label ids 0, 1, 2
NEUTRAL = 2  #: the label of a sentence without keyword
POSITIVE = ("great", "good", "excellent", "wonderful", "superb", "lovely", "brilliant", "delightful", "amazing",
            "fantastic")
NEGATIVE = ("awful", "bad", "terrible", "horrible", "dreadful", "poor", "boring", "disappointing", "ugly",
            "miserable")
FILLER = ("the", "a", "movie", "film", "was", "is", "this", "it", "plot", "actor", "scene", "story", "and", "of",
          "in", "with", "on", "that", "director", "music", "ending", "script", "cast", "very", "quite", "really",
          "seemed", "felt", "overall", "which", "we", "they", "watched", "saw", "yesterday", "today", "cinema",
          "screen", "show", "rather")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # [PAD] is id 0
#: Held-out sentences come from this seed offset on, so training seeds (below it) never overlap them.
HELD_OUT_SEED = 10_000
#: Sentence lengths in words (keyword included) that make_examples draws by default, as the demo model was trained.
MIN_WORDS, MAX_WORDS = 4, 12


@dataclass(frozen=True)
class Example:
    """One sentence: ``words[evidence_index] == evidence`` is the keyword that decides ``label``
    (neutral sentences: ``evidence == ""`` and ``evidence_index == -1``)."""

    text: str
    label: int
    evidence: str
    evidence_index: int  #: word index of the keyword in ``text.split()``

    @property
    def words(self) -> list[str]:
        return self.text.split()


def vocabulary() -> list[str]:
    """Every token of the demo tokenizer, in id order (special tokens first)."""
    return [*SPECIAL_TOKENS, *FILLER, *NEGATIVE, *POSITIVE]


def make_examples(
    n: int, seed: int = 0, *, min_words: int = MIN_WORDS, max_words: int = MAX_WORDS, neutral: float = 0.0
) -> list[Example]:
    """``n`` sentences of ``min_words``..``max_words`` words: a share ``neutral`` without keyword, the rest
    with one keyword, positive and negative balanced in expectation."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if neutral and rng.random() < neutral:  # no extra draw when neutral == 0: same sentences as before
            words = [rng.choice(FILLER) for _ in range(rng.randint(min_words, max_words))]
            out.append(Example(text=" ".join(words), label=NEUTRAL, evidence="", evidence_index=-1))
            continue
        label = rng.randrange(2)
        keyword = rng.choice(POSITIVE if label else NEGATIVE)
        words = [rng.choice(FILLER) for _ in range(rng.randint(min_words, max_words) - 1)]
        index = rng.randint(0, len(words))
        words.insert(index, keyword)
        out.append(Example(text=" ".join(words), label=label, evidence=keyword, evidence_index=index))
    return out
