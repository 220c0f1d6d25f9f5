"""Tiny models for the offline faithfulness benchmark, each trained in seconds on 2 CPU cores.

    python examples/train_tasks.py --out /tmp/tasks     # writes /tmp/tasks/{sentiment,agreement}/ and prints JSON

- ``sentiment``: the keyword task of ``nxl demo`` (:mod:`nxl_hooks.demo.task`) on a 2-block BERT
  classifier (``build_model`` of ``examples/train_demo.py``), trained here with 15% of the words replaced by
  ``[MASK]`` (as BERT sees in pre-training): mask-token perturbation is then in distribution, so a sentence
  whose keyword is masked gets p close to 0.5 instead of an arbitrary confident guess. Evidence = the keyword.
  ``train_demo_recipe`` is the shipped demo model's own recipe (a Llama classifier), benchmarked beside it.
- ``agreement``: subject-verb number agreement in the spirit of BLiMP. A 2-block Llama causal LM reads
  ``<s> the [adjectives] N1 P the N2 [P the N3] ADVERB`` and must continue with ``is`` after a singular N1 and
  ``are`` after a plural one; the attractor nouns N2, N3 have random number. Evidence = the subject N1,
  target = the correct verb, foil = the wrong one.

Deterministic for a seed (single-threaded data generation, fixed torch seed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_demo beside this file
from train_demo import build_model, build_tokenizer  # noqa: E402
from train_demo import train as train_demo_recipe  # noqa: E402  (the shipped demo model's own recipe)

from nxl_hooks.demo.task import HELD_OUT_SEED  # noqa: E402
from nxl_hooks.demo.task import make_examples as _sentiment_examples  # noqa: E402

__all__ = ["agreement_examples", "sentiment_examples", "train_agreement", "train_demo_recipe", "train_sentiment"]

NOUNS = ("key", "dog", "cat", "author", "teacher", "car", "book", "house", "painting", "bottle", "student",
         "doctor", "table", "letter", "bridge", "garden")
ADJECTIVES = ("old", "new", "big", "small", "red", "green", "quiet", "famous")
PREPOSITIONS = ("to", "near", "of", "behind", "beside", "with", "under", "for")
ADVERBS = ("really", "surely", "still", "now", "truly", "clearly")  # between the last noun and the verb
ENDINGS = ("here", "there", "ready", "broken", "missing", "fine", "gone", "lost")
VERBS = ("is", "are")
_SPECIAL = ("<pad>", "<unk>", "<s>")


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("s", "ch", "sh", "x")) else "s")


def agreement_vocabulary() -> list[str]:
    nouns = [form for noun in NOUNS for form in (noun, _plural(noun))]
    return [*_SPECIAL, "the", ".", *VERBS, *nouns, *ADJECTIVES, *PREPOSITIONS, *ADVERBS, *ENDINGS]


def agreement_examples(n: int, seed: int = 0) -> list[dict]:
    """``n`` evaluation examples: {"text": prompt, "label"/"target": correct verb, "foil", "evidence", "sentence"}."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        subject, *others = rng.sample(NOUNS, 3)  # attractors never share the subject's lemma
        plural = rng.random() < 0.5
        head = _plural(subject) if plural else subject
        words = ["the", *rng.sample(ADJECTIVES, rng.randint(0, 2)), head]
        for noun in others[: rng.randint(1, 2)]:
            words += [rng.choice(PREPOSITIONS), "the", _plural(noun) if rng.random() < 0.5 else noun]
        words.append(rng.choice(ADVERBS))  # the prediction position, left out of every ranking, is not a noun
        verb, foil = ("are", "is") if plural else ("is", "are")
        prompt = " ".join(words)
        out.append({"text": prompt, "label": verb, "target": verb, "foil": foil, "evidence": [head],
                    "sentence": f"{prompt} {verb} {rng.choice(ENDINGS)} ."})
    return out


def agreement_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer that prepends ``<s>``."""
    vocab = {token: index for index, token in enumerate(agreement_vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   model_max_length=32)


def train_agreement(seed: int = 0, n_train: int = 6000, epochs: int = 2, batch_size: int = 64, lr: float = 3e-3):
    """``(model, tokenizer)``: a 2-block Llama trained as a language model on full agreement sentences."""
    tokenizer = agreement_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, pad_token_id=0, bos_token_id=2, eos_token_id=None,
        tie_word_embeddings=False,
    ))
    sentences = [ex["sentence"] for ex in agreement_examples(n_train, seed=seed)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    order = random.Random(seed)
    model.train()
    for _ in range(epochs):
        order.shuffle(sentences)
        for start in range(0, len(sentences), batch_size):
            enc = tokenizer(sentences[start : start + batch_size], padding=True, return_tensors="pt")
            labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
            loss = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval(), tokenizer


def train_sentiment(seed: int = 0, n_train: int = 4000, epochs: int = 3, batch_size: int = 32, lr: float = 2e-3,
                    mask_rate: float = 0.15):
    """``(model, tokenizer)``: the demo's BERT classifier trained with ``mask_rate`` of the words masked."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed)
    data = _sentiment_examples(n_train, seed=seed)
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    special = torch.tensor(tokenizer.all_special_ids)
    model.train()
    for _ in range(epochs):
        rng.shuffle(data)
        for start in range(0, len(data), batch_size):
            part = data[start : start + batch_size]
            enc = tokenizer([ex.text for ex in part], padding=True, return_tensors="pt", return_token_type_ids=False)
            words = ~torch.isin(enc["input_ids"], special)
            masked = words & (torch.rand(enc["input_ids"].shape, generator=generator) < mask_rate)
            ids = enc["input_ids"].masked_fill(masked, tokenizer.mask_token_id)
            loss = model(input_ids=ids, attention_mask=enc["attention_mask"],
                         labels=torch.tensor([ex.label for ex in part])).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval(), tokenizer


def sentiment_examples(n: int, seed: int = HELD_OUT_SEED) -> list[dict]:
    """Held-out sentiment examples as evaluation dicts: {"text", "label", "evidence"}."""
    return [{"text": ex.text, "label": ex.label, "evidence": [ex.evidence]} for ex in _sentiment_examples(n, seed=seed)]


@torch.no_grad()
def agreement_accuracy(model, tokenizer, examples: list[dict]) -> float:
    """Share of prompts where the model prefers the correct verb over the wrong one (BLiMP-style)."""
    hits = 0
    is_id, are_id = tokenizer.convert_tokens_to_ids(["is", "are"])
    for ex in examples:
        logits = model(**tokenizer(ex["text"], return_tensors="pt")).logits[0, -1]
        prefers_is = logits[is_id] > logits[are_id]
        hits += int(prefers_is == (ex["target"] == "is"))
    return hits / len(examples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for sentiment/ and agreement/")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # bit-for-bit reproducible weights
    report = {}
    for name, trainer in (("sentiment", train_sentiment), ("agreement", train_agreement)):
        model, tokenizer = trainer(seed=args.seed)
        model.save_pretrained(args.out / name)
        tokenizer.save_pretrained(args.out / name)
        report[name] = str(args.out / name)
    held_out = agreement_examples(500, seed=HELD_OUT_SEED + args.seed)
    report["agreement_accuracy"] = agreement_accuracy(model, tokenizer, held_out)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
