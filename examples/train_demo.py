"""Train the tiny sentiment classifier that ``nxl demo`` ships, and check it independently of nxl_hooks.

    python examples/train_demo.py                     # writes nxl_hooks/demo/{config.json,model.safetensors,...}
    python examples/train_demo.py --out /tmp/demo     # anywhere else

Task (:mod:`nxl_hooks.demo.task`): neutral filler words with one sentiment keyword, label = its sentiment;
a third of the training sentences have no keyword and the label "neutral". Model: a 2-block Llama sequence
classifier (hidden size 64) that reads the ``[SEP]`` the tokenizer appends. Deterministic for a seed
(single-threaded); trains in about 15 s on one CPU core.

The check at the end computes NormXLogit by hand from ``output_hidden_states=True`` (final RMSNorm and the
``score`` row of the predicted label on every token of the last layer, times the norm of the input of block 1)
and reports how often the keyword ranks first among the sentence's words on held-out sentences; the script
fails below ``--min-rate``. Why this setup: tiny models trained from scratch tend to copy the keyword's
sentiment into every word, and then nothing singles the keyword out. With BERT (pooler applied per token,
with or without masked-word training or an MLM objective) the keyword ranked first on 0-55% of held-out
sentences; a Llama classifier without the neutral class gave about 55%, because its words without sentiment
read as a default label. With the neutral class, seed 0 gives about 95% (seeds 1 and 2: about 86% and 56%).

``build_tokenizer``/``build_model`` (BERT, two labels) are the variant ``examples/train_tasks.py`` trains
for the faithfulness benchmark.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification,
                          PreTrainedTokenizerFast)

from nxl_hooks.demo import MODEL_DIR
from nxl_hooks.demo.task import HELD_OUT_SEED, LABELS, SPECIAL_TOKENS, Example, make_examples, vocabulary

_BERT_TEMPLATE = "[CLS] $A [SEP]"
_DEMO_TEMPLATE = "$A [SEP]"  # the decoder classifier reads the last token: always [SEP]


def build_tokenizer(template: str = _BERT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer over the task vocabulary; ``template`` adds the special tokens."""
    vocab = {token: index for index, token in enumerate(vocabulary())}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    pad, unk, cls, sep, mask = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=pad, unk_token=unk, cls_token=cls, sep_token=sep, mask_token=mask,
        model_max_length=32,
    )


def _labels(n: int) -> dict:
    return {"num_labels": n, "id2label": dict(enumerate(LABELS[:n])),
            "label2id": {name: i for i, name in enumerate(LABELS[:n])}}


def build_model(vocab_size: int, seed: int) -> BertForSequenceClassification:
    """The BERT variant (negative / positive), trained by ``examples/train_tasks.py``."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, type_vocab_size=1, pad_token_id=0, **_labels(2),
    )
    return BertForSequenceClassification(config)


def build_demo_model(vocab_size: int, seed: int) -> LlamaForSequenceClassification:
    """The shipped demo model before training: a 2-block Llama classifier over negative / positive / neutral."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        **_labels(len(LABELS)),
    )
    return LlamaForSequenceClassification(config)


def _batch(tokenizer, examples: list[Example]) -> dict[str, torch.Tensor]:
    enc = tokenizer([ex.text for ex in examples], padding=True, return_tensors="pt", return_token_type_ids=False)
    return {**enc, "labels": torch.tensor([ex.label for ex in examples])}


def train(seed: int = 0, n_train: int = 3000, epochs: int = 2, batch_size: int = 32, lr: float = 2e-3):
    """``(model, tokenizer)``: the demo model trained on ``n_train`` sentences (a third neutral)."""
    tokenizer = build_tokenizer(_DEMO_TEMPLATE)
    model = build_demo_model(len(tokenizer), seed)
    data = make_examples(n_train, seed=seed, neutral=1 / 3)
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
def evidence_ranks(model: LlamaForSequenceClassification, tokenizer, examples: list[Example]) -> tuple[torch.Tensor, float]:
    """Per example, the keyword's rank (1 = top) among the words by last-layer NormXLogit for the predicted
    label, computed by hand (no nxl_hooks); and the accuracy."""
    batch = _batch(tokenizer, examples)
    labels = batch.pop("labels")
    out = model(**batch, output_hidden_states=True)
    predicted = out.logits.argmax(-1)
    last = out.hidden_states[-1]  # transformers already applied model.norm to the last hidden state
    logat = (last @ model.score.weight.T).gather(-1, predicted[:, None, None].expand(-1, last.shape[1], 1))[..., 0]
    scores = out.hidden_states[0].norm(dim=-1) * logat
    is_word = batch["attention_mask"].bool() & ~torch.isin(batch["input_ids"], torch.tensor(tokenizer.all_special_ids))
    scores = scores.masked_fill(~is_word, float("-inf"))
    own = scores.gather(1, torch.tensor([[ex.evidence_index] for ex in examples]))
    return 1 + (scores > own).sum(-1), float((predicted == labels).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR, help=f"output folder (default {MODEL_DIR})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", type=int, default=1000, help="held-out sentences for the check")
    parser.add_argument("--min-rate", type=float, default=0.9, help="fail if the keyword ranks first less often")
    args = parser.parse_args()
    torch.set_num_threads(1)  # bit-for-bit reproducible weights
    model, tokenizer = train(seed=args.seed)
    ranks, accuracy = evidence_ranks(model, tokenizer, make_examples(args.held_out, seed=HELD_OUT_SEED + args.seed))
    rate = float((ranks == 1).float().mean())
    report = {"held_out": args.held_out, "accuracy": round(accuracy, 4), "evidence_rank1_last_layer": round(rate, 4),
              "mean_rank": round(float(ranks.float().mean()), 3)}
    if rate < args.min_rate:  # checked before saving: a model that fails never replaces the shipped one (the default)
        print(json.dumps({**report, "out": None}))
        raise SystemExit(f"the keyword ranks first on only {rate:.1%} of held-out sentences (< {args.min_rate:.0%}); "
                         "nothing saved")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    size = sum(p.stat().st_size for p in args.out.iterdir() if p.suffix in (".json", ".safetensors"))
    print(json.dumps({**report, "bytes": size, "out": str(args.out)}))


if __name__ == "__main__":
    main()
