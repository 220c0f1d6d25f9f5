"""Train the tiny sentiment classifier that ``nxl demo`` ships, and check it independently of nxl_hooks.

    python examples/train_demo.py                     # writes nxl_hooks/demo/{config.json,model.safetensors,...}
    python examples/train_demo.py --out /tmp/demo     # anywhere else

Task (:mod:`nxl_hooks.demo.task`): neutral filler words with one sentiment keyword, label = its sentiment.
Model: a 2-block BERT for sequence classification, hidden size 32 (the paper's main setting: BERT's pooler
applied to every token). Deterministic for a seed; trains in a few seconds on 2 CPU cores.

The check at the end computes NormXLogit by hand from ``output_hidden_states=True`` (pooler dense + tanh +
classifier on every token of the last layer, times the norm of the input of block 1) and reports how often the
keyword ranks first among the sentence's words on held-out sentences; the script fails below ``--min-rate``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

from nxl_hooks.demo import MODEL_DIR
from nxl_hooks.demo.task import HELD_OUT_SEED, LABELS, SPECIAL_TOKENS, Example, make_examples, vocabulary


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer over the task vocabulary, adding [CLS] ... [SEP] like BERT."""
    vocab = {token: index for index, token in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    pad, unk, cls, sep, mask = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=pad, unk_token=unk, cls_token=cls, sep_token=sep, mask_token=mask,
        model_max_length=32,
    )


def build_model(vocab_size: int, seed: int) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, type_vocab_size=1, num_labels=len(LABELS), pad_token_id=0,
        id2label=dict(enumerate(LABELS)), label2id={name: i for i, name in enumerate(LABELS)},
    )
    return BertForSequenceClassification(config)


def _batch(tokenizer, examples: list[Example]) -> dict[str, torch.Tensor]:
    enc = tokenizer([ex.text for ex in examples], padding=True, return_tensors="pt")
    enc.pop("token_type_ids", None)
    return {**enc, "labels": torch.tensor([ex.label for ex in examples])}


def train(seed: int = 0, n_train: int = 4000, epochs: int = 3, batch_size: int = 32, lr: float = 2e-3):
    """``(model, tokenizer)`` trained on ``n_train`` task sentences; deterministic for ``seed``."""
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), seed)
    data = make_examples(n_train, seed=seed)
    order = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    for _ in range(epochs):
        order.shuffle(data)
        for start in range(0, len(data), batch_size):
            loss = model(**_batch(tokenizer, data[start : start + batch_size])).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval(), tokenizer


@torch.no_grad()
def evidence_ranks(model: BertForSequenceClassification, tokenizer, examples: list[Example]) -> tuple[torch.Tensor, float]:
    """Per example, the keyword's rank (1 = top) among the words by last-layer NormXLogit for the predicted
    label, computed by hand (no nxl_hooks); and the accuracy."""
    batch = _batch(tokenizer, examples)
    labels = batch.pop("labels")
    out = model(**batch, output_hidden_states=True)
    predicted = out.logits.argmax(-1)
    last = out.hidden_states[-1]  # BERT is post-LN: no final norm to apply
    pooled = torch.tanh(last @ model.bert.pooler.dense.weight.T + model.bert.pooler.dense.bias)
    logat = pooled @ model.classifier.weight.T + model.classifier.bias  # (batch, seq, labels)
    logat = logat.gather(-1, predicted[:, None, None].expand(-1, logat.shape[1], 1))[..., 0]
    scores = out.hidden_states[0].norm(dim=-1) * logat
    special = torch.tensor(tokenizer.all_special_ids)
    is_word = batch["attention_mask"].bool() & ~torch.isin(batch["input_ids"], special)
    scores = scores.masked_fill(~is_word, float("-inf"))
    keyword = torch.tensor([ex.evidence_index + 1 for ex in examples])  # +1 for [CLS]
    own = scores.gather(1, keyword[:, None])
    ranks = 1 + (scores > own).sum(-1)
    return ranks, float((predicted == labels).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help=f"output folder (default {MODEL_DIR})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", type=int, default=1000, help="held-out sentences for the check")
    parser.add_argument("--min-rate", type=float, default=0.9, help="fail if the keyword ranks first less often")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = train(seed=args.seed)
    ranks, accuracy = evidence_ranks(model, tokenizer, make_examples(args.held_out, seed=HELD_OUT_SEED + args.seed))
    rate = float((ranks == 1).float().mean())
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    size = sum(p.stat().st_size for p in args.out.iterdir() if p.suffix in (".json", ".safetensors"))
    print(json.dumps({"held_out": args.held_out, "accuracy": accuracy, "evidence_rank1_last_layer": rate,
                      "mean_rank": float(ranks.float().mean()), "bytes": size, "out": str(args.out)}))
    if rate < args.min_rate:
        raise SystemExit(f"the keyword ranks first on only {rate:.1%} of held-out sentences (< {args.min_rate:.0%})")


if __name__ == "__main__":
    main()
