"""Tiny models for the offline faithfulness benchmark, each trained in seconds on 2 CPU cores.

    python examples/train_tasks.py --out /tmp/tasks   # /tmp/tasks/{sentiment,agreement,agreement_ft,agreement_mlm}/

- ``sentiment``: the keyword task of ``nxl demo`` (:mod:`nxl_hooks.demo.task`) on a 2-block BERT
  classifier (``build_model`` of ``examples/train_demo.py``), trained here with 15% of the words replaced by
  ``[MASK]`` (as BERT sees in pre-training): mask-token perturbation is then in distribution, so a sentence
  whose keyword is masked gets p close to 0.5 instead of an arbitrary confident guess. Evidence = the keyword.
  ``train_demo_recipe`` is the shipped demo model's own recipe (a Llama classifier), benchmarked beside it.
- ``agreement``: subject-verb number agreement in the spirit of BLiMP. A 2-block Llama causal LM reads
  ``<s> the [adjectives] N1 P the N2 [P the N3] ADVERB`` and must continue with ``is`` after a singular N1 and
  ``are`` after a plural one; the attractor nouns N2, N3 have random number. Evidence = the subject N1,
  target = the correct verb, foil = the wrong one. ``agreement_mlm``: the same sentences for a 2-block BERT
  masked LM that fills ``<mask>`` in the verb slot (the paper's BLiMP setting uses masked LMs).
- ``agreement_ft``: the paper's BLiMP fine-tuning protocol (the model is optimized to pick the correct verb over
  the foil at the verb slot only): ``train_agreement(verb_only=True)``, the causal LM with the loss on the verb
  alone. The masked-LM twin is ``train_agreement_mlm(mask_rate=0.0)``: only the verb masked, loss only there.

Deterministic for a seed (single-threaded data generation, fixed torch seed).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_demo beside this file
from train_demo import build_model, build_tokenizer  # noqa: E402
from train_demo import train as train_demo_recipe  # noqa: E402  (the shipped demo model's own recipe)

from nxl_hooks.demo.task import HELD_OUT_SEED  # noqa: E402
from nxl_hooks.demo.task import make_examples as _sentiment_examples  # noqa: E402

__all__ = ["agreement_examples", "sentiment_examples", "train_agreement", "train_agreement_mlm", "train_demo_recipe",
           "train_sentiment"]

NOUNS = ("key", "dog", "cat", "author", "teacher", "car", "book", "house", "painting", "bottle", "student",
         "doctor", "table", "letter", "bridge", "garden")
ADJECTIVES = ("old", "new", "big", "small", "red", "green", "quiet", "famous")
PREPOSITIONS = ("to", "near", "of", "behind", "beside", "with", "under", "for")
ADVERBS = ("really", "surely", "still", "now", "truly", "clearly")  # between the last noun and the verb
ENDINGS = ("here", "there", "ready", "broken", "missing", "fine", "gone", "lost")
VERBS = ("is", "are")
_SPECIAL = ("<pad>", "<unk>", "<s>", "</s>", "<mask>")


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("s", "ch", "sh", "x")) else "s")


def agreement_vocabulary() -> list[str]:
    nouns = [form for noun in NOUNS for form in (noun, _plural(noun))]
    return [*_SPECIAL, "the", ".", *VERBS, *nouns, *ADJECTIVES, *PREPOSITIONS, *ADVERBS, *ENDINGS]


def agreement_examples(n: int, seed: int = 0, *, masked: bool = False) -> list[dict]:
    """``n`` evaluation examples: {"text", "label"/"target": correct verb, "foil", "evidence", "sentence"}.

    ``text`` is the prompt up to the verb, or with ``masked=True`` the whole sentence with ``<mask>`` as verb.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        subject, *others = rng.sample(NOUNS, 3)  # attractors never share the subject's lemma
        plural = rng.random() < 0.5
        head = _plural(subject) if plural else subject
        words = ["the", *rng.sample(ADJECTIVES, rng.randint(0, 2)), head]
        for noun in others[: rng.randint(1, 2)]:
            words += [rng.choice(PREPOSITIONS), "the", _plural(noun) if rng.random() < 0.5 else noun]
        words.append(rng.choice(ADVERBS))  # the causal LM's prediction position, left out of rankings: not a noun
        verb, foil = ("are", "is") if plural else ("is", "are")
        prompt, ending = " ".join(words), f"{rng.choice(ENDINGS)} ."
        out.append({"text": f"{prompt} <mask> {ending}" if masked else prompt, "label": verb, "target": verb,
                    "foil": foil, "evidence": [head], "sentence": f"{prompt} {verb} {ending}"})
    return out


def agreement_tokenizer(masked: bool = False) -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer: ``<s> words`` for the causal LM, ``<s> words </s>`` for the masked LM."""
    vocab = {token: index for index, token in enumerate(agreement_vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>" if masked else "<s> $A", special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   cls_token="<s>", sep_token="</s>", mask_token="<mask>", model_max_length=32)


def _fit(model, items: list, make_batch, seed: int, epochs: int, batch_size: int, lr: float):
    """AdamW over shuffled mini-batches; ``make_batch(items)`` gives the model's keyword arguments with labels."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    order = random.Random(seed)
    items = list(items)
    model.train()
    for _ in range(epochs):
        order.shuffle(items)
        for start in range(0, len(items), batch_size):
            loss = model(**make_batch(items[start : start + batch_size])).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


def _masked_words(tokenizer, texts: list[str], rate: float, generator: torch.Generator) -> tuple[dict, torch.Tensor]:
    """The encoded batch and a random choice of ``rate`` of its non-special tokens (True = to mask)."""
    enc = tokenizer(texts, padding=True, return_tensors="pt", return_token_type_ids=False)
    words = ~torch.isin(enc["input_ids"], torch.tensor(tokenizer.all_special_ids))
    return enc, words & (torch.rand(enc["input_ids"].shape, generator=generator) < rate)


def train_agreement(seed: int = 0, n_train: int = 6000, epochs: int = 2, batch_size: int = 64, lr: float = 3e-3,
                    verb_only: bool = False):
    """``(model, tokenizer)``: a 2-block Llama trained as a language model on full agreement sentences.

    ``verb_only=True`` is the paper's fine-tuning protocol for BLiMP: the loss is only on the verb, so the
    model is optimized to pick the correct verb over the foil and learns nothing else.
    """
    tokenizer = agreement_tokenizer()
    verbs = torch.tensor(tokenizer.convert_tokens_to_ids(list(VERBS)))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, pad_token_id=0, bos_token_id=2, eos_token_id=None,
        tie_word_embeddings=False,
    ))

    def batch(sentences: list[str]) -> dict:
        enc = tokenizer(sentences, padding=True, return_tensors="pt")
        scored = torch.isin(enc["input_ids"], verbs) if verb_only else enc["attention_mask"] == 1
        return {**enc, "labels": enc["input_ids"].masked_fill(~scored, -100)}

    sentences = [ex["sentence"] for ex in agreement_examples(n_train, seed=seed)]
    return _fit(model, sentences, batch, seed, epochs, batch_size, lr), tokenizer


def train_agreement_mlm(seed: int = 0, n_train: int = 6000, epochs: int = 16, batch_size: int = 64, lr: float = 2e-3,
                        mask_rate: float = 0.15):
    """``(model, tokenizer)``: a 2-block BERT masked LM; the verb is always masked, other words at ``mask_rate``."""
    tokenizer = agreement_tokenizer(masked=True)
    torch.manual_seed(seed)
    model = BertForMaskedLM(BertConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=32, type_vocab_size=1, pad_token_id=0,
    ))
    generator = torch.Generator().manual_seed(seed)
    verbs = torch.tensor(tokenizer.convert_tokens_to_ids(list(VERBS)))

    def batch(sentences: list[str]) -> dict:
        enc, chosen = _masked_words(tokenizer, sentences, mask_rate, generator)
        chosen |= torch.isin(enc["input_ids"], verbs)
        labels = enc["input_ids"].masked_fill(~chosen, -100)
        return {**enc, "input_ids": enc["input_ids"].masked_fill(chosen, tokenizer.mask_token_id), "labels": labels}

    sentences = [ex["sentence"] for ex in agreement_examples(n_train, seed=seed)]
    return _fit(model, sentences, batch, seed, epochs, batch_size, lr), tokenizer


def train_sentiment(seed: int = 0, n_train: int = 4000, epochs: int = 3, batch_size: int = 32, lr: float = 2e-3,
                    mask_rate: float = 0.15):
    """``(model, tokenizer)``: the demo's BERT classifier trained with ``mask_rate`` of the words masked."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed)
    generator = torch.Generator().manual_seed(seed)

    def batch(examples: list) -> dict:
        enc, chosen = _masked_words(tokenizer, [ex.text for ex in examples], mask_rate, generator)
        return {**enc, "input_ids": enc["input_ids"].masked_fill(chosen, tokenizer.mask_token_id),
                "labels": torch.tensor([ex.label for ex in examples])}

    return _fit(model, _sentiment_examples(n_train, seed=seed), batch, seed, epochs, batch_size, lr), tokenizer


def sentiment_examples(n: int, seed: int = HELD_OUT_SEED) -> list[dict]:
    """Held-out sentiment examples as evaluation dicts: {"text", "label", "evidence"}."""
    return [{"text": ex.text, "label": ex.label, "evidence": [ex.evidence]} for ex in _sentiment_examples(n, seed=seed)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for sentiment/, agreement/, agreement_ft/, agreement_mlm/")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # bit-for-bit reproducible weights
    report = {}
    for name, trainer in (("sentiment", train_sentiment), ("agreement", train_agreement),
                          ("agreement_ft", functools.partial(train_agreement, verb_only=True)),
                          ("agreement_mlm", train_agreement_mlm)):
        start = time.perf_counter()
        model, tokenizer = trainer(seed=args.seed)
        model.save_pretrained(args.out / name)
        tokenizer.save_pretrained(args.out / name)
        report[name] = {"path": str(args.out / name), "train_seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
