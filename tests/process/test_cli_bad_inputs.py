"""The command line's catalogue of bad inputs (issue 12): each case exits with code 2 and one stderr line that names
the real cause (matched like ``pytest.raises(match=...)``), never a traceback, and leaves every file that was
there byte for byte as it was (models, datasets, earlier outputs the failed command was pointed at).

The library's catalogue is tests/unit/test_bad_inputs.py; :func:`test_docs_state_the_catalogue` checks the figures in
docs/testing.md against both.
"""

from __future__ import annotations

import html
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import tiny
from nxl_hooks.apps.cli import main
from test_bad_inputs import CATALOGUE as LIBRARY_CATALOGUE

TEXT = "the film was good"
LONG = " ".join(["film"] * 100)  # 102 tokens with [CLS] and [SEP]: the tiny BERT has 64 positions
LAYERS = r"layer 9 is out of range: this model has 2 blocks"
NOUSER = "~nxl-no-such-user"  # a ~user path of no user: pathlib's RuntimeError was a traceback
HOMELESS = NOUSER + r" names no home folder on this machine \(no such user\); spell the path out"

CASES = [
    # attribute: where the results go, checked before the model loads
    ("out in a missing folder", ["attribute", "{bert}", TEXT, "--out", "{root}/nope/a.safetensors"],
     r"--out .*/nope/a.safetensors: the folder .*/nope does not exist"),
    ("out is a folder", ["attribute", "{bert}", TEXT, "--out", "{outdir}"], r"--out .*/outdir is a folder, not a file"),
    ("html in a missing folder", ["attribute", "{bert}", TEXT, "--html", "{root}/nope/a.html"],
     r"--html .*/nope/a.html: the folder .*/nope does not exist"),
    ("html is a folder", ["attribute", "{bert}", TEXT, "--html", "{outdir}"], r"--html .*/outdir is a folder"),
    # a folder where nothing can be written (/proc: not even root), tried before the model loads
    ("out in a folder that takes no file", ["attribute", "{bert}", TEXT, "--out", "/proc/a.safetensors"],
     r"--out /proc/a.safetensors: nothing can be written in the folder /proc \(No such file or directory\): give a "
     r"folder you can write in$"),
    ("out empty", ["attribute", "{bert}", TEXT, "--out", ""], r"--out is empty: give a file name"),  # was '.'
    ("html blank", ["attribute", "{bert}", TEXT, "--html", " "], r"--html is empty: give a file name"),  # wrote ' '
    ("export out empty", ["export", "{streams}/run.nxl", ""], r"OUT.parquet is empty: give a file name"),
    ("export out in a folder that takes no file", ["export", "{streams}/run.nxl", "/proc/o.parquet"],
     r"OUT.parquet /proc/o.parquet: nothing can be written in the folder /proc"),
    ("out below a file", ["attribute", "{bert}", TEXT, "--out", "{existing_html}/a.safetensors"],
     r"the folder .*existing.html is a file, not a folder"),
    ("out is a FIFO", ["attribute", "{bert}", TEXT, "--out", "{fifo}"],
     r"--out .*/fifo is a FIFO \(named pipe\), not a regular file: nxl_hooks writes results only as regular files"),
    ("html is a symbolic link", ["attribute", "{bert}", TEXT, "--html", "{link}"],
     r"--html .*/link is a symbolic link, not a regular file"),
    ("generated stream to a FIFO", ["attribute", "{llama}", TEXT, "--generate", "2", "--out", "{fifo}"],
     r"--out .*/fifo is a FIFO"),
    ("out and html one file", ["attribute", "{bert}", TEXT, "--out", "{root}/same.x", "--html", "{root}/same.x"],
     r"--out and --html both name .*same.x: the page would replace the scores; give two paths"),
    ("out over the model's weights", ["attribute", "{bert}", TEXT, "--out", "{bert}/model.safetensors"],
     r"--out .*/bert/model.safetensors would write into .*/bert, an input of this command: write the output "
     r"elsewhere"),
    ("html into the model folder", ["attribute", "{bert}", TEXT, "--html", "{bert}/../bert/page.html"],
     r"--html .*/page.html would write into .*/bert, an input of this command"),
    ("text pair empty", ["attribute", "{bert}", TEXT, "--text-pair", " "],
     r"TEXT2 is empty: give the second text of the pair, or leave --text-pair out"),
    ("text pair with generate", ["attribute", "{llama}", TEXT, "--text-pair", "bad", "--generate", "2"],
     r"--text-pair with --generate: a sentence pair is a classifier's input, .*; drop one of them"),
    ("text pair on a LM", ["attribute", "{llama}", TEXT, "--text-pair", "bad"],
     r"--text-pair is a classifier's second text, and .*llama is a causal lm model, which reads one text: join"),
    ("target id beyond any integer", ["attribute", "{llama}", TEXT, "--target", "99999999999999999999999"],
     r"target 99999999999999999999999 is out of range"),
    ("device map on a GPU not there", ["attribute", "{bert}", TEXT, "--device-map", "cuda:99"],
     r"--device-map: 'cuda:99': this machine has (no cuda device|\d+ cuda device\(s\)); give auto, cpu"),
    # a module's place may be disk and no strategy, the whole model's the other way round: each lists its own
    ("device map of no device", ["attribute", "{bert}", TEXT, "--device-map", '{{"": "nope"}}'],
     r"'nope' is no device: give cpu, disk, or a device such as cuda:0 or its number \(see"),
    ("device map of no device for the whole model", ["attribute", "{bert}", TEXT, "--device-map", "nope"],
     r"'nope' is no device: give auto, balanced, sequential, cpu, a device such as cuda:0 or its number, or a "
     r"mapping \{module: device\} \(which may put modules on disk\)"),
    ("device map mapping a module by a strategy", ["attribute", "{bert}", TEXT, "--device-map", '{{"": "auto"}}'],
     r"--device-map: 'auto': a strategy places the whole model, not one module of a mapping \(give --device-map "
     r"\(device_map=\) auto alone\); in a mapping, give cpu, disk, or a device"),
    ("device map by a number not there", ["attribute", "{bert}", TEXT, "--device-map", "99"], r"--device-map: 99: "
     r"this machine has (no accelerator device|\d+ accelerator device\(s\)); give auto, cpu"),
    ("device map onto a numbered CPU", ["attribute", "{llama}", TEXT, "--device-map",
                                        '{{"model": "cpu", "lm_head": "cpu:1"}}'],
     r"--device-map: 'cpu:1': the CPU is one device, with no number; write cpu"),
    ("device map on meta", ["attribute", "{bert}", TEXT, "--device-map", "meta"],
     r"--device-map: 'meta' holds no weights \(the meta device has shapes, not data\); give auto, cpu"),
    ("device map mapping onto meta", ["attribute", "{bert}", TEXT, "--device-map", '{{"": "meta"}}'], "'meta' h"),
    ("device map all on disk", ["attribute", "{bert}", TEXT, "--device-map", "disk"],
     r"--device-map: 'disk' for the whole model: transformers places no model on disk alone; give auto with "
     r"--max-memory \(max_memory=\), which offloads what does not fit, or a mapping of the model's own module names "
     r"\(print\(model\) shows them\), such as a Llama-like decoder's \{"),  # (a BERT's modules are named otherwise)
    ("device map of the whole model and a module on disk", ["attribute", "{llama}", TEXT, "--device-map",
                                                             '{{"lm_head": "disk", "": "cpu"}}'],
     r"--device-map: \{\"lm_head\": \"disk\", \"\": \"cpu\"\}: \"\" \(the whole model\) beside modules on disk "
     r"does not load .*; drop \"\" and name each module: a mapping of the model's own module names"),
    ("offload folder below a file", ["attribute", "{bert}", TEXT, "--device-map", "auto", "--offload-folder",
                                     "{existing_html}/off"],
     r"--offload-folder: .*existing.html/off: .*existing.html is a file, not a folder; give a folder"),
    ("offload folder in the model's folder", ["attribute", "{bert}", TEXT, "--device-map", "auto", "--offload-folder",
                                              "{bert}/off"],
     r"--offload-folder .*/bert/off \(offload_folder=\) would write into .*/bert, the model's folder: .*; give a "
     r"folder elsewhere"),
    ("max memory on a device not there", ["attribute", "{bert}", TEXT, "--device-map", "auto", "--max-memory",
                                          "99=10GiB"],
     r"--max-memory: 99: this machine has (no accelerator device|\d+ accelerator device\(s\)); cap cpu, or a device"),
    ("max memory of a strategy", ["attribute", "{bert}", TEXT, "--device-map", "auto", "--max-memory", "auto=1GiB"],
     r"--max-memory: 'auto' is a placing strategy, not a device; cap cpu, disk, or a device such as cuda:0"),
    ("max memory of no device", ["attribute", "{bert}", TEXT, "--device-map", "auto", "--max-memory", "gpu0=1GiB"],
     r"--max-memory: 'gpu0' is no device: cap cpu, disk, or a device such as cuda:0 or its number"),
    ("8-bit with part of the model on disk", ["attribute", "{bert}", TEXT, "--device-map", "auto", "--max-memory",
                                              "cpu=1KB", "--load-in-8bit"],
     r"bert: --load-in-8bit/--load-in-4bit \(quantize=\) quantize the model where it runs, and --device-map "
     r"\(device_map=\) puts part of it on the CPU or disk: give the device it runs on room for the whole model with "
     r"--max-memory \(max_memory=\), or drop --load-in-8bit/--load-in-4bit \(quantize=\)$"),
    ("out in an unknown user's home", ["attribute", "{bert}", TEXT, "--out", NOUSER + "/a.safetensors"],
     NOUSER + "/a.safetensors: " + HOMELESS),
    ("offload folder in an unknown user's home", ["attribute", "{bert}", TEXT, "--device-map", "auto",
                                                  "--offload-folder", NOUSER + "/off"], "/off: " + HOMELESS),
    # attribute: the model folder
    ("model in an unknown user's home", ["attribute", NOUSER + "/m", TEXT], NOUSER + "/m: " + HOMELESS),
    ("truncated weights", ["attribute", "{truncated}", TEXT, "--out", "{existing_st}"],
     r"truncated/model.safetensors is damaged \(.*incomplete metadata.*\): it is truncated or not a safetensors"),
    ("zeroed weights", ["attribute", "{zeroed}", TEXT], r"zeroed/model.safetensors is damaged \(.*invalid JSON"),
    ("config does not match the weights", ["attribute", "{mismatch}", TEXT],
     r"mismatch/config.json does not match the weights: bert.embeddings.word_embeddings.weight is \[20, 32\] in "
     r"model.safetensors but \[20, 64\] for the config"),
    ("weights without the head", ["attribute", "{headless}", TEXT],  # (the masked LM's tied decoder is no gap)
     r"headless lacks tensors the model needs \(classifier.bias, classifier.weight\): they would be random numbers; "
     r"save the whole model again \(model.save_pretrained\), or pass the --head \(head=\) its weights were "
     r"trained with"),
    ("evaluate weights without the head", ["evaluate", "{headless}", "{data}", "--out", "{root}/o"],
     r"headless lacks tensors the model needs"),
    # a model NormXLogit does not explain, refused before its weights load (--head built the same class, or none)
    ("vision-language checkpoint", ["attribute", "{vlm}", TEXT],
     r"vlm: config.architectures names \['Gemma3ForConditionalGeneration'\]; NormXLogit explains the head of a "
     r"decoder-only or encoder text model .* vision-language .* not supported \(docs/supported-models.md\)$"),
    # a base model's config: --head builds a task model of it, so the line says which
    ("base-model checkpoint", ["attribute", "{base}", TEXT],
     r"base: config.architectures \(\['LlamaModel'\]\) names no head that NormXLogit explains; pass --head "
     r"\(head=\) with one of causal_lm, sequence_classification$"),
    # an encoder-decoder classifier (its head reads the decoder): attach said to register 'bart', after the load
    ("encoder-decoder classifier checkpoint", ["attribute", "{seq2seq}", TEXT],
     r"seq2seq: config.architectures names \['BartForSequenceClassification'\]; NormXLogit explains the head of "
     r"a decoder-only or encoder text model .* encoder-decoder \(T5, BART, .* not supported"),
    # saved from a subclass of the user's own (class SentimentModel(BertForSequenceClassification)): its name was
    # said to be a model NormXLogit does not explain (encoder-decoder, token classification...); --head loads it
    ("checkpoint of a user's subclass", ["attribute", "{subclass}", TEXT],
     r"subclass: config.architectures \(\['SentimentModel'\]\) names no class of transformers; pass --head "
     r"\(head=\) with one of causal_lm, sequence_classification, masked_lm$"),
    # a model type of which no head is explained (T5), saved from the user's subclass or as its base model: it said
    # to pass --head with any of causal_lm, sequence_classification, masked_lm, each of which --head then refused
    ("checkpoint of a user's subclass of T5", ["attribute", "{seq2seq_own}", TEXT],
     r"seq2seq_own: NormXLogit explains no head of t5 models; NormXLogit explains the head of a decoder-only or "
     r"encoder text model .* encoder-decoder \(T5, BART, .* not supported"),
    ("T5 base-model checkpoint", ["attribute", "{seq2seq_base}", TEXT],
     r"seq2seq_base: NormXLogit explains no head of t5 models; NormXLogit explains the head of a decoder-only or "
     r"encoder text model .* encoder-decoder \(T5, BART, .* not supported"),
    ("vision-language checkpoint as a causal LM", ["attribute", "{vlm}", TEXT, "--head", "causal_lm"],
     r"vlm: transformers builds gemma3 models as Gemma3ForConditionalGeneration for causal_lm; NormXLogit explains "
     r"the head of a decoder-only or encoder text model"),
    ("config head count 0", ["attribute", "{noheads}", TEXT],
     r"noheads/config.json: num_attention_heads is 0; a size must be a whole number above 0: use the config.json"),
    ("config width a string", ["attribute", "{textwidth}", TEXT], r"textwidth/config.json: hidden_size is '32'"),
    ("config value of the wrong type", ["attribute", "{texteps}", TEXT],
     r"texteps: transformers rejects its config.json \(StrictDataclassFieldValidationError: .*'layer_norm_eps' "
     r"expected float, got str.*\); use the config.json saved with these weights"),
    ("config of a model that cannot be built", ["attribute", "{negpositions}", TEXT],
     r"negpositions/config.json: transformers cannot build the model it describes \(RuntimeError: .*negative "
     r"dimension -5.*\); use the config.json saved"),
    ("config of more blocks than tensors", ["attribute", "{manyblocks}", TEXT],  # at once, not minutes building it
     r"manyblocks/config.json: num_hidden_layers is 1000000, but the weights hold \d+ tensors in all \(blocks 0..1\), "
     r"too few for that many blocks; use the config.json saved with these weights"),
    ("shard index reaching outside the folder", ["attribute", "{outsideshard}", TEXT],
     r"outsideshard/model.safetensors.index.json names the shard '../bert/model.safetensors', which is not a file name "
     r"in .*/outsideshard: a model's shards lie in its own folder; put the shard beside the index"),
    ("shard index naming a missing shard", ["attribute", "{missingshard}", TEXT],
     r"missingshard/model.safetensors.index.json names the shard model-00002-of-00002.safetensors, which is not in "),
    ("PEFT adapter folder", ["attribute", "{adapter}", TEXT],
     r"adapter is a PEFT adapter \(adapter_config.json\), not a whole model: merge it into its base model '.*/bert' "
     r"and pass the merged folder \(PeftModel.from_pretrained\(base, folder\).merge_and_unload\(\)"),
    ("config not JSON", ["attribute", "{badconfig}", TEXT], r"config file at '.*badconfig/config.json' is not a valid"),
    ("no tokenizer", ["attribute", "{notokenizer}", TEXT], r"notokenizer has no tokenizer \(none of tokenizer.json"),
    ("tokenizer config without a vocabulary", ["attribute", "{vocabless}", TEXT],
     r"vocabless: its tokenizer \(BertTokenizer\) has no vocabulary, only its special tokens \(\[CLS\], .*\), so it "
     r"would read every word as unknown: its vocabulary file is missing; save it beside the model"),
    ("damaged tokenizer", ["attribute", "{badtokenizer}", TEXT],
     r"badtokenizer: its tokenizer cannot be read \(JSONDecodeError"),
    ("no model folder", ["attribute", "{root}/nope", TEXT], r"no model folder at .*/nope: check the path"),
    ("gguf file not there", ["attribute", "{bert}", TEXT, "--gguf-file", "x.gguf"], r"has no file 'x.gguf'"),
    ("gguf MODEL not there", ["attribute", "{root}/x.gguf", TEXT], r"no GGUF file at .*/x.gguf"),
    # attribute: the text and the options
    ("text beyond the positions", ["attribute", "{bert}", LONG],
     r"TEXT is 102 tokens, but the model reads at most 64 \(config.max_position_embeddings\)"),
    ("text beyond the positions, --out existing", ["attribute", "{bert}", LONG, "--out", "{existing_st}",
                                                   "--html", "{existing_html}"], r"TEXT is 102 tokens"),
    ("generate beyond the positions", ["attribute", "{llama}", TEXT, "--generate", "3000", "--out", "{existing_nxl}"],
     r"TEXT is 6 tokens plus 3000 to generate, but the model reads at most 2048"),
    ("text empty", ["attribute", "{bert}", " "], r"TEXT is empty: give the text to explain"),
    ("weights only as a pickle", ["attribute", "{pickled}", TEXT],
     r"pickled holds its weights as pickle files only \(pytorch_model.bin\): nxl_hooks never loads pickle"),
    ("a model that needs its own code", ["attribute", "{remotecode}", TEXT],
     r"remotecode needs code of its own to load \(auto_map in its config\): nxl_hooks never runs code"),
    ("masked LM text without its mask", ["attribute", "{mlm}", TEXT],
     r"TEXT has no \[MASK\] token: a masked LM explains what it predicts at its mask token; put \[MASK\] where"),
    ("masked LM tokenizer without a mask token", ["attribute", "{nomask}", TEXT],
     r"nomask's tokenizer has no mask token: a masked LM explains what it predicts at its mask token; save the model "
     r"with the tokenizer it was trained with"),
    ("text not UTF-8", ["attribute", "{bert}", "caf\udce9 film"], r"argument b'caf\\xe9 film' is not UTF-8 text"),
    ("generate on a classifier, --out existing", ["attribute", "{bert}", TEXT, "--generate", "2", "--out",
                                                  "{existing_nxl}"],
     r"--generate needs a causal LM, and .*bert is a sequence classification model \(it generates nothing\): drop "
     r"--generate to explain its prediction for TEXT"),
    ("target not in the vocabulary", ["attribute", "{llama}", TEXT, "--target", "zebra"],
     r"target 'zebra' is not a single token in the vocabulary"),
    ("target list names one output twice", ["attribute", "{bert}", TEXT, "--target", "1,LABEL_1", "--method",
                                            "contrastive"],
     r"target list names output 1 twice \(1 and 'LABEL_1'\): give different targets \(a target and its foil\)"),
    ("label not the model's", ["attribute", "{bert}", TEXT, "--target", "joyful"],
     r"label 'joyful' is not one of the model's labels"),
    ("layer out of range", ["attribute", "{bert}", TEXT, "--layers", "9"], LAYERS),
    ("layers not a list", ["attribute", "{bert}", TEXT, "--layers", "x"],
     r"argument --layers: 'x': use 'all', 'last' or a comma list"),
    ("generate with target", ["attribute", "{llama}", TEXT, "--generate", "2", "--target", "1"],
     r"--generate explains each emitted token: drop --target"),
    ("chat without a template", ["attribute", "{bert}", TEXT, "--chat"], r"this tokenizer has no chat template"),
    ("8bit and 4bit", ["attribute", "{bert}", TEXT, "--load-in-8bit", "--load-in-4bit"],
     r"--load-in-8bit and --load-in-4bit exclude each other"),
    # said by the command's parser, naming it (it said "nxl: error: ... (see nxl --help)"), or by nxl's
    ("unknown option", ["attribute", "{bert}", TEXT, "--colour", "1"],
     r"^nxl attribute: error: unrecognized arguments: --colour 1 \(see nxl attribute --help\)$"),
    ("unknown option of demo", ["demo", "the plot", "--layers", "9"],
     r"^nxl demo: error: unrecognized arguments: --layers 9 \(see nxl demo --help\)$"),
    ("unknown option before the command", ["--colour", "demo", "the plot", "--layers", "9"],
     r"^nxl: error: unrecognized arguments: --colour \(see nxl --help\)$"),
    ("nxl's own option after the command", ["demo", "the plot", "--traceback"],
     r"^nxl: error: --traceback is nxl's own option: give it before the command \(nxl --traceback demo \.\.\.\)"),
    # evaluate: the dataset
    ("csv row with extra cells", ["evaluate", "{bert}", "{extra_csv}", "--out", "{root}/o"],
     r"extra.csv:3 has 3 cells but the header names 2: quote cells that hold a comma"),
    ("deeply nested JSON line", ["evaluate", "{bert}", "{nested}", "--out", "{root}/o"],
     r"nested.jsonl:2 is not valid JSON \(nested too deeply to read\)"),
    ("dataset not UTF-8", ["evaluate", "{bert}", "{latin1}", "--out", "{root}/o"],
     r"latin1.jsonl:2 is not UTF-8 text \(byte b'\\xe9'\): save the file as UTF-8"),
    # one NaN gold value made every Pearson of a regression run None, said nowhere, and wrote a NaN that is not JSON
    ("JSONL label NaN", ["evaluate", "{regression}", "{nanlabel}", "--out", "{root}/o"],
     r"nanlabel.jsonl:2: label nan is not a finite number: give a number, or leave the label out"),
    ("CSV label inf", ["evaluate", "{regression}", "{inflabel}", "--out", "{root}/o"],
     r"inflabel.csv:3: label inf is not a finite number"),
    # a valid JSON escape that is no character: each example failed with a tokenizer's TypeError, the run went on
    ("JSONL text with a lone surrogate", ["evaluate", "{bert}", "{surrogate}", "--out", "{root}/o"],
     r"surrogate.jsonl:2: text holds '\\ud800', half of a UTF-16 surrogate pair without the other half, which is "
     r"no character: write the character itself"),
    ("empty dataset", ["evaluate", "{bert}", "{empty}", "--out", "{root}/o"], r"empty.jsonl holds no examples"),
    ("line without text", ["evaluate", "{bert}", "{notext}", "--out", "{root}/o"],
     r"notext.jsonl:1 has no non-empty 'text' field \(it has \['sentence'\]\); pick it with --text-field"),
    # where in the line (json's message was cut before it: "Unterminated string starting at")
    ("line not JSON", ["evaluate", "{bert}", "{badline}", "--out", "{root}/o"],
     r"badline.jsonl:2 is not valid JSON \(Expecting property name enclosed in double quotes: column 2\)"),
    ("line with a string not ended", ["evaluate", "{bert}", "{unended}", "--out", "{root}/o"],
     r"unended.jsonl:2 is not valid JSON \(Unterminated string starting at: column 10\)"),
    ("csv evidence not JSON", ["evaluate", "{bert}", "{badevidence}", "--out", "{root}/o"],
     r"badevidence.csv:2: field 'evidence': Expecting value: column \d+"),
    ("no dataset", ["evaluate", "{bert}", "{root}/nope.jsonl", "--out", "{root}/o"], r"no dataset at .*nope.jsonl"),
    ("dataset is a folder", ["evaluate", "{bert}", "{outdir}", "--out", "{root}/o"], r"no dataset at .*outdir"),
    ("hub dataset spec", ["evaluate", "{bert}", "hf:x", "--out", "{root}/o"], r"'hf:x': write a hub dataset as"),
    # evaluate: options and the output folder
    ("methods empty", ["evaluate", "{bert}", "{data}", "--out", "{root}/o", "--methods", ""],
     r"--methods '' names no method; choose from random"),
    ("methods unknown", ["evaluate", "{bert}", "{data}", "--out", "{root}/o", "--methods", "logat,shap"],
     r"--methods 'logat,shap' names unknown \['shap'\]"),
    ("evaluate out is a file", ["evaluate", "{bert}", "{data}", "--out", "{existing_html}"],
     r"--out .*existing.html: .*existing.html is a file, not a folder"),
    ("evaluate layer out of range", ["evaluate", "{bert}", "{data}", "--out", "{outdir}", "--layer", "9"], LAYERS),
    ("evaluate contrastive on a regression head", ["evaluate", "{regression}", "{data}", "--out", "{root}/o",
                                                   "--methods", "logat,contrastive"],
     r"--methods names contrastive, which contrasts the target with a foil, but .*/regression has a regression head "
     r"\(one output, no foil\): drop it from --methods"),
    ("evaluate damaged weights", ["evaluate", "{truncated}", "{data}", "--out", "{outdir}"],
     r"truncated/model.safetensors is damaged"),
    ("evaluate limit 0", ["evaluate", "{bert}", "{data}", "--out", "{outdir}", "--limit", "0"],
     r"argument --limit: '0': give a whole number of at least 1"),
    ("evaluate out in an unknown user's home", ["evaluate", "{bert}", "{data}", "--out", NOUSER + "/o"], HOMELESS),
    ("evaluate out where no folder can be made", ["evaluate", "{bert}", "{data}", "--out", "/proc/nxl-no/o"],
     r"--out /proc/nxl-no/o: the folder /proc/nxl-no cannot be made \(No such file or directory\): give a folder "
     r"you can write in$"),
    ("evaluate out empty", ["evaluate", "{bert}", "{data}", "--out", ""], r"--out is empty: give a folder"),
    ("evaluate data as the out's records", ["evaluate", "{bert}", "{inout}/records.jsonl", "--out", "{inout}"],
     r"--out .*/inout would write over .*/inout/records.jsonl, an input of this command"),
    ("evaluate out in the model folder", ["evaluate", "{bert}", "{data}", "--out", "{bert}"],
     r"--out .*/bert would write into .*/bert, an input"),
    ("evaluate part file a symbolic link", ["evaluate", "{bert}", "{data}", "--out", "{linked_part}"],
     r"linked_part/parts/part-0.jsonl is a symbolic link, not a regular file: nxl_hooks writes results only as"),
    ("evaluate records a symbolic link", ["evaluate", "{bert}", "{data}", "--out", "{linked_records}"],
     r"linked_records/records.jsonl is a symbolic link, not a regular file"),
    # a label or evidence column named that no example has (a typo): the run had no labels, or no evidence, silently
    ("label field in no example", ["evaluate", "{bert}", "{data}", "--out", "{root}/o", "--label-field", "lable"],
     r"data.jsonl has no 'lable' field in any example \(they have \['label', 'text'\]\): pick it with --label-field, "
     r"or leave --label-field out$"),
    ("evidence field in no example", ["audit", "--reference", "{bert}", "--candidate", "{bert}", "{data}", "--out",
                                      "{root}/o", "--evidence-field", "rationale"],
     r"data.jsonl has no 'rationale' field in any example \(they have \['label', 'text'\]\): pick it with "
     r"--evidence-field, or leave --evidence-field out$"),
    # audit
    ("audit without a candidate", ["audit", "--reference", "{bert}", "{data}", "--out", "{outdir}"],
     r"give exactly one of --candidate MODEL or --quantize"),
    ("audit candidate without tokenizer", ["audit", "--reference", "{bert}", "--candidate", "{notokenizer}", "{data}",
                                           "--out", "{outdir}"], r"notokenizer has no tokenizer"),
    ("audit candidate config mismatch", ["audit", "--reference", "{bert}", "--candidate", "{mismatch}", "{data}",
                                         "--out", "{outdir}"], r"config.json does not match the weights"),
    ("audit candidate of another head", ["audit", "--reference", "{bert}", "--candidate", "{llama}", "{data}",
                                         "--out", "{root}/o"],
     r"the candidate has a causal_lm head of 20 outputs but the reference a sequence_classification head of 2 outputs "
     r"\(LABEL_0, LABEL_1\): an audit compares one output of both models, so give a candidate with the reference's"),
    # a property of the model: refused once, where every example failed alike (each with this reason)
    ("audit a masked LM", ["audit", "--reference", "{mlm}", "--candidate", "{mlm}", "{data}", "--out", "{root}/o"],
     r"--reference .*/mlm: a masked LM cannot be audited: the audit compares classifiers and causal LMs; audit a "
     r"classifier built on it$"),
    ("audit candidate with other labels", ["audit", "--reference", "{bert}", "--candidate", "{relabelled}", "{data}",
                                           "--out", "{root}/o"],
     r"the candidate has a sequence_classification head of 2 outputs \(neg, pos\) but the reference a "
     r"sequence_classification head of 2 outputs \(LABEL_0, LABEL_1\)"),
    ("audit candidate that tokenizes otherwise", ["audit", "--reference", "{bert}", "--candidate", "{retokenized}",
                                                  "{data}", "--out", "{root}/o"],
     r"the candidate's tokenizer reads example 0 as 'the film was good' but the reference's as '\[CLS\] the film was "
     r"good \[SEP\]': the audit feeds both models the reference's tokens, so both must share one tokenizer$"),
    ("audit layers out of range", ["audit", "--reference", "{bert}", "--candidate", "{bert}", "{data}", "--out",
                                   "{outdir}", "--layers", "9"], LAYERS),
    ("audit out is a file", ["audit", "--reference", "{bert}", "--candidate", "{bert}", "{data}", "--out",
                             "{existing_html}"], r"existing.html is a file, not a folder"),
    ("audit out in the candidate's folder", ["audit", "--reference", "{bert}", "--candidate", "{zeroed}", "{data}",
                                             "--out", "{zeroed}/audit"], r"would write into .*/zeroed, an input"),
    ("audit out empty", ["audit", "--reference", "{bert}", "--candidate", "{bert}", "{data}", "--out", ""],
     r"--out is empty: give a folder"),
    ("audit out where no folder can be made", ["audit", "--reference", "{bert}", "--candidate", "{bert}", "{data}",
                                               "--out", "/proc/nxl-no"], r"--out /proc/nxl-no: the folder /proc/nxl-no "
     r"cannot be made"),
    ("audit csv extra cells", ["audit", "--reference", "{bert}", "--quantize", "8bit", "{extra_csv}", "--out",
                               "{outdir}"], r"extra.csv:3 has 3 cells"),
    # export: the Parquet file is none of the streams it reads, --force or not
    ("export a stream over itself", ["export", "{streams}/run.nxl", "{streams}/run.nxl", "--force"],
     r"OUT.parquet .*/run.nxl would write over .*/streams/run.nxl, an input of this command"),
    ("export source not there", ["export", "{root}/nope.nxl", "{root}/o.parquet"],
     r"no stream file or run folder at .*/nope.nxl: give a file a sink wrote"),
    ("export a folder without streams", ["export", "{outdir}", "{root}/o.parquet"],
     r"outdir is a folder with no stream file \(\*.nxl\) below it: give the folder of nxl run --sink"),
    ("export to a name of another format", ["export", "{streams}/run.nxl", "{root}/o.HTML"],
     r"OUT.parquet .*/o.HTML: nxl export writes Parquet, not an HTML page: name the file .parquet"),
    ("export over a stream of its folder", ["export", "{streams}", "{streams}/run.nxl", "--force"],
     r"OUT.parquet .*/run.nxl would write over .*/streams/run.nxl, an input"),
    # demo: the arguments are checked before its model loads
    ("demo text not UTF-8", ["demo", "the plot was \udcff good"], r"argument b'the plot was \\xff good' is not UTF-8"),
    ("demo empty sentence", ["demo", " "], r"the demo sentence is empty: give one with a sentiment keyword, or none"),
    ("demo two keywords", ["demo", "good and terrible"], r"exactly one sentiment keyword \(found 2\)"),
    # the demo tokenizer has no capitals or punctuation: the near-miss keyword is named, not "found 0"
    ("demo keyword with punctuation", ["demo", "the plot was superb!"],
     r"no sentiment keyword the model reads: 'superb!' is read as \[UNK\]: write 'superb'$"),
    ("demo keyword capitalised", ["demo", "the plot was Superb"],
     r"no sentiment keyword the model reads: 'Superb' is read as \[UNK\]: write 'superb'$"),
    ("demo example out of range", ["demo", "--example", "5000"], r"--example 5000: choose 0..999"),
    ("demo sentence and example", ["demo", "the plot was good", "--example", "3"],
     r"either a sentence or --example N \(a held-out sentence\), not both"),
    # run, tail, ctl
    ("run sink is a file", ["run", "--sink", "{existing_html}", "--", "true"],
     r"--sink .*existing.html: .*existing.html is a file, not a folder"),
    ("run sink in an unknown user's home", ["run", "--sink", NOUSER + "/s", "--", "true"], HOMELESS),
    ("run sink where no folder can be made", ["run", "--sink", "/proc/nxl-no-such/s", "--", "true"],
     r"/proc/nxl-no-such/s: the folder /proc/nxl-no-such cannot be made \(No such file or directory\): give a "
     r"folder you can write in$"),
    ("run without a program", ["run", "--sink", "{outdir}"], r"give the program to run after --"),
    # a sink of one file (parquet:, file:) makes no folder: the program would run unrecorded; with {model}, the folder
    # above the model's name is what is known before the program loads one
    ("run parquet sink in a missing folder", ["run", "--sink", "parquet:{root}/nope/x.parquet", "--", "true"],
     r"--sink parquet:.*/nope/x.parquet: the folder .*/nope does not exist \(the sink makes no folder\); create the "
     r"folder or pick another path$"),
    # the sink would be refused in the program, said in its log only: the program ran unrecorded
    ("run parquet sink of no file", ["run", "--sink", "parquet:", "--", "true"],
     r"--sink parquet: names no file: give the file the sink writes after the colon \(parquet:PATH\)$"),
    ("attach parquet sink of no file", ["attach", "1", "--sink", "parquet:"],
     r"--sink parquet: names no file: give the file the sink writes after the colon \(parquet:PATH\)$"),
    ("run file sink that is a folder", ["run", "--sink", "file:{outdir}", "--", "true"],
     r"--sink file:.*/outdir: .*/outdir is a folder, and a file sink writes one file: give a file's path"),
    ("run file sink per model in a missing folder", ["run", "--sink", "file:{root}/nope/{{model}}/x.nxl", "--", "true"],
     r"--sink file:.*/nope/\{model\}/x.nxl: the folder .*/nope does not exist"),
    # written twice: refused before the program starts, as resolving it in the program would refuse it
    ("run target written twice", ["run", "--target", "5,5", "--", "true"],
     r"argument --target: target list names output 5 twice \(5 and 5\): give different targets"),
    ("run target mixing predicted", ["run", "--target", "predicted,5", "--", "true"],
     r"argument --target: 'predicted' cannot be mixed with other targets; pass it alone"),
    ("run target with an empty item", ["run", "--target", "5,,6", "--", "true"],
     r"argument --target: '5,,6': empty item in the target list"),
    ("run methods an evaluation baseline", ["run", "--methods", "logat,random", "--", "true"],
     r"--methods: 'random' names a record field or one of nxl evaluate's baselines, never a method a probe computes: "
     r"choose from normxlogit, logat\b.*, or a method a plugin or your program registers"),
    ("run listen on a bare IPv6 address", ["run", "--listen", "::1", "--", "true"],
     r"--listen '::1': write an IPv6 address in brackets, with its port: \[::1\]:8765"),
    ("run program not found", ["run", "--", "{root}/no-such-program"],
     r"no-such-program: command not found \(or not executable\)"),
    ("tail run not there", ["tail", "--run", "{root}/nope"], r"nope: no run folder or control socket there"),
    ("tail run without sockets", ["tail", "--run", "{outdir}"], r"outdir: no running process has a control socket"),
    ("tail run that has ended", ["tail", "--run", "{ended_run}"], r"ended_run: no running process has a control "
     r"socket there \(the program has ended, or not loaded a model yet\); what it recorded is on disk: nxl export "
     r".*ended_run records\.parquet, or nxl\.read_stream\(folder\) in Python"),
    ("tail http without token", ["tail", "--run", "http://127.0.0.1:9"], r"needs its bearer token: pass --token-file"),
    ("tail token file not there", ["tail", "--run", "http://127.0.0.1:9", "--token-file", "{root}/nope"],
     r"no token file at .*nope: give the token file of the run"),
    ("tail token file empty", ["tail", "--run", "http://127.0.0.1:9", "--token-file", "{empty_token}"],
     r"empty_token does not hold a bearer token \(one word of printable ASCII\): give the token file nxl run"),
    ("tail run empty", ["tail", "--run", ""], r"--run is empty: give the folder nxl run printed, a control socket "
     r"or http://127.0.0.1:PORT, or leave --run out for your one live run$"),  # was "nxl export  records.parquet"
    ("ctl run blank", ["ctl", "status", "--run", " "], r"--run is empty: give the folder nxl run printed"),
    # an input path left empty (a variable unset) is the current folder to pathlib: the lines named nothing
    ("model empty", ["attribute", "", TEXT], r"argument MODEL: '' is empty: give a path or a name"),
    ("evaluate data empty", ["evaluate", "{bert}", "", "--out", "{root}/o"],
     r"argument DATA: '' is empty: give a path or a name"),  # was "--out .../o would write into , an input"
    ("audit candidate empty", ["audit", "--reference", "{bert}", "--candidate", " ", "{data}", "--out", "{root}/o"],
     r"argument --candidate: ' ' is empty"),
    ("export source empty", ["export", "", "{root}/o.parquet"], r"argument RUN_DIR_OR_STREAM: '' is empty"),
    ("convert MODEL empty", ["convert", "", "{root}/o"], r"argument MODEL: '' is empty"),
    ("ctl run is a file", ["ctl", "status", "--run", "{existing_html}"], r"no run folder or control socket there"),
    ("ctl https", ["ctl", "pause", "--run", "https://127.0.0.1:9"], r"speaks plain HTTP on loopback; use http://"),
    ("ctl unknown action", ["ctl", "stop"], r"argument action: invalid choice: 'stop'"),
    ("ctl pause with an attach option", ["ctl", "pause", "--layers", "2", "--run", "{outdir}"],
     r"nxl ctl pause takes no option \(--layers given\): the attach options apply to nxl ctl attach"),
    ("ctl detach with an attach option", ["ctl", "detach", "--models", "a*", "--embedding", "word"],
     r"nxl ctl detach takes only --models \(--embedding given\)"),
    ("ctl http without a host", ["ctl", "status", "--run", "http://"],
     r"http://: give the address nxl run --listen printed, http://127.0.0.1:PORT"),
    # convert: a GGUF file into a model folder
    ("convert OUT in an unknown user's home", ["convert", "{root}/x.gguf", NOUSER + "/out"], "/out: " + HOMELESS),
    ("convert MODEL in an unknown user's home", ["convert", NOUSER + "/x.gguf", "{root}/o"], "/x.gguf: " + HOMELESS),
    # attach: how long to wait, checked before any process is touched
    ("attach timeout not a number", ["attach", "1", "--timeout", "nan"],
     r"--timeout: 'nan': give a number of seconds, more than 0"),
    ("attach wait negative", ["attach", "1", "--wait", "-5"], r"--wait: '-5': give a number of seconds, 0 or more"),
]
CLI_CATALOGUE = [case[0] for case in CASES]


@pytest.fixture(scope="module")
def where(tmp_path_factory) -> dict[str, str]:
    """The files the cases use: tiny models (whole, damaged, mismatched), datasets, and earlier outputs."""
    root = tmp_path_factory.mktemp("cli")
    bert = tiny.save_model(root / "bert", "bert")
    llama = tiny.save_model(root / "llama", "llama")
    regression = tiny.save_model(root / "regression", "regression")
    mlm = tiny.save_model(root / "mlm", "mlm")
    nomask = tiny.save_model(root / "nomask", "mlm")
    (nomask / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((nomask / "tokenizer_config.json").read_text()), "mask_token": None}))
    weights = (bert / "model.safetensors").read_bytes()
    damaged = {
        "truncated": lambda p: (p / "model.safetensors").write_bytes(weights[: len(weights) // 2]),
        "zeroed": lambda p: (p / "model.safetensors").write_bytes(bytes(len(weights))),
        "mismatch": lambda p: _edit(p / "config.json", hidden_size=64, intermediate_size=128),
        # config.json values transformers divides by, type-checks or builds tensors of: one line each, not a traceback
        "noheads": lambda p: _edit(p / "config.json", num_attention_heads=0),
        "textwidth": lambda p: _edit(p / "config.json", hidden_size="32"),
        "texteps": lambda p: _edit(p / "config.json", layer_norm_eps="x"),
        "negpositions": lambda p: _edit(p / "config.json", max_position_embeddings=-5),
        "manyblocks": lambda p: _edit(p / "config.json", num_hidden_layers=10**6),
        # a shard index whose weights lie elsewhere (read unchecked), or are not there
        "outsideshard": lambda p: _shard_index(p, "../bert/model.safetensors"),
        "missingshard": lambda p: _shard_index(p, "model-00002-of-00002.safetensors"),
        "badconfig": lambda p: (p / "config.json").write_text("{oops"),
        "headless": lambda p: save_file({k: v for k, v in load_file(p / "model.safetensors").items()
                                         if not k.startswith("classifier.")}, p / "model.safetensors"),
        "relabelled": lambda p: _edit(p / "config.json", id2label={"0": "neg", "1": "pos"},
                                      label2id={"neg": 0, "pos": 1}),
        "notokenizer": lambda p: [(p / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
        # the weights as a pickle (torch.load would run what it holds): never read
        "pickled": lambda p: (torch.save(load_file(p / "model.safetensors"), p / "pytorch_model.bin"),
                              (p / "model.safetensors").unlink()),
        # code of its own to load (auto_map, a model_type transformers does not ship): never run
        "remotecode": lambda p: (_edit(p / "config.json", model_type="evilbert", auto_map={
            "AutoConfig": "evil.EvilConfig", "AutoModelForSequenceClassification": "evil.Evil"}),
            (p / "evil.py").write_text(f"open({str(p / 'RAN')!r}, 'w')\n")),
        "badtokenizer": lambda p: (p / "tokenizer.json").write_text("{oops"),
        # one vocabulary, but no [CLS] ... [SEP] added: the same ids for the words, another input to the model
        "retokenized": lambda p: tiny.word_tokenizer(tiny.VOCAB).save_pretrained(p),
        # a vision-language model's config.json (AutoModelForCausalLM builds Gemma3ForConditionalGeneration)
        "base": lambda p: transformers.LlamaConfig(architectures=["LlamaModel"]).save_pretrained(p),
        "vlm": lambda p: transformers.Gemma3Config(architectures=["Gemma3ForConditionalGeneration"]).save_pretrained(p),
        "subclass": lambda p: _edit(p / "config.json", architectures=["SentimentModel"]),
        "seq2seq": lambda p: transformers.BartConfig(architectures=["BartForSequenceClassification"]).save_pretrained(
            p),
        "seq2seq_own": lambda p: transformers.T5Config(architectures=["MyT5"]).save_pretrained(p),
        "seq2seq_base": lambda p: transformers.T5Config(architectures=["T5Model"]).save_pretrained(p),
        # a PEFT adapter (PeftModel.save_pretrained): the adapter's files beside the tokenizer, no config.json
        "adapter": lambda p: ((p / "config.json").unlink(), (p / "model.safetensors").rename(
            p / "adapter_model.safetensors"), (p / "adapter_config.json").write_text(json.dumps(
                {"peft_type": "LORA", "base_model_name_or_path": str(p.parent / "bert")}))),
        # tokenizer_config.json naming a tokenizer whose vocabulary file is not there: it loads, holding no word
        "vocabless": lambda p: ((p / "tokenizer.json").unlink(),
                                _edit(p / "tokenizer_config.json", tokenizer_class="BertTokenizer")),
    }
    paths = {"root": str(root), "bert": str(bert), "llama": str(llama), "regression": str(regression),
             "mlm": str(mlm), "nomask": str(nomask)}
    for name, damage in damaged.items():
        shutil.copytree(bert, root / name)
        damage(root / name)
        paths[name] = str(root / name)
    good = '{"text": "the film was good", "label": 1}\n'
    datasets = {  # key in the cases: file name, content
        "data": ("data.jsonl", good * 2),
        "extra_csv": ("extra.csv", "text,label\nthe film,1\nthe plot,0,oops\n"),
        "nested": ("nested.jsonl", good + '{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n"),
        "latin1": ("latin1.jsonl", good.encode() + '{"text": "café"}\n'.encode("latin-1")),
        "empty": ("empty.jsonl", "\n\n"),
        "notext": ("notext.jsonl", '{"sentence": "the film"}\n'),
        "badline": ("badline.jsonl", good + "{oops\n"),
        "unended": ("unended.jsonl", good + '{"text": "the film\n'),
        "badevidence": ("badevidence.csv", 'text,evidence\nthe film,"[oops"\n'),
        "nanlabel": ("nanlabel.jsonl", good + '{"text": "the film", "label": NaN}\n'),
        "inflabel": ("inflabel.csv", "text,label\nthe film,0.5\nthe plot,inf\n"),
        "surrogate": ("surrogate.jsonl", good + '{"text": "the film \\ud800 was good", "label": 1}\n'),
    }
    for key, (name, content) in datasets.items():
        (root / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        paths[key] = str(root / name)
    outdir = root / "outdir"  # an earlier run's folder, and earlier single-file outputs
    outdir.mkdir()
    (outdir / "summary.json").write_text('{"n": 1}\n')
    for key, name in (("existing_st", "existing.safetensors"), ("existing_html", "existing.html"),
                      ("existing_nxl", "existing.nxl")):
        (root / name).write_bytes(f"precious {name}\n".encode() * 8)
        paths[key] = str(root / name)
    paths["outdir"] = str(outdir)
    (root / "inout").mkdir()  # a folder holding the data under the name of a run's records
    (root / "inout" / "records.jsonl").write_text(good * 2)
    (root / "streams").mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "data" / "stream-v2.nxl", root / "streams" / "run.nxl")
    paths["inout"], paths["streams"] = str(root / "inout"), str(root / "streams")
    (root / "ended_run" / "123-tiny").mkdir(parents=True)  # a run folder whose program ended: records, no socket
    shutil.copy(root / "streams" / "run.nxl", root / "ended_run" / "123-tiny" / "00000001-00000123.nxl")
    paths["ended_run"] = str(root / "ended_run")
    os.mkfifo(root / "fifo")  # special files where results would go: never replaced by one
    (root / "link").symlink_to(root / "existing.html")
    paths["fifo"], paths["link"] = str(root / "fifo"), str(root / "link")
    (root / "empty_token").touch(mode=0o600)  # a token file of the right mode holding nothing
    paths["empty_token"] = str(root / "empty_token")
    for key, planted in (("linked_part", "parts/part-0.jsonl"), ("linked_records", "records.jsonl")):
        (root / key / planted).parent.mkdir(parents=True)  # a run folder with a link where the run writes
        (root / key / planted).symlink_to(root / "existing.html")
        paths[key] = str(root / key)
    return paths


def _edit(path: Path, **fields) -> None:
    """Set ``fields`` in the JSON file at ``path`` (a copy's config.json or tokenizer_config.json)."""
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _shard_index(folder: Path, shard: str) -> None:
    """Replace the folder's model.safetensors by a shard index (model.safetensors.index.json) naming ``shard`` for
    every tensor."""
    weight_map = dict.fromkeys(load_file(folder / "model.safetensors"), shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "model.safetensors").unlink()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def quiet():
    """No progress bars on stderr: what is left there is what nxl itself says."""
    transformers.utils.logging.disable_progress_bar()
    yield
    transformers.utils.logging.enable_progress_bar()


class _Writes(io.StringIO):
    """stderr that keeps each write apart: a line must leave in one write, newline included, or two torchrun ranks
    (``python -u``: stderr unbuffered) run their lines into one."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)

    def text(self) -> str:
        """What was written; AssertionError when a write left a line unfinished (a progress bar's, which starts
        with a carriage return, aside)."""
        assert all(text.endswith("\n") for text in self.writes if text and not text.startswith("\r")), self.writes
        return self.getvalue()


def _started(*program) -> None:
    raise AssertionError(f"the program started: {program[1]}")


@pytest.mark.parametrize("argv, message", [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_bad_cli_input(where, quiet, monkeypatch, argv, message):
    monkeypatch.setenv("NXL_TOKEN", "")
    root = Path(where["root"])
    before = _tree(root)
    monkeypatch.setattr(sys, "stderr", _Writes())
    monkeypatch.setattr(os, "execvpe", _started)  # nxl run's program: it would replace this process
    assert main([arg.format(**where) for arg in argv]) == 2
    err = sys.stderr.text()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.match(r"nxl( \w+)?: error: ", lines[0]) and re.search(message, lines[0]), lines[0]
    assert _tree(root) == before  # nothing created, nothing changed, nothing removed


def test_evaluate_records_a_text_too_long_and_goes_on(where, quiet, tmp_path, monkeypatch):
    """One text beyond the model's positions: recorded as failed with its reason, the others scored; a rerun
    resumes without retrying it (the records on disk stay as they were)."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in [{"id": "a", "text": "the film was good", "label": 1},
                                                             {"id": "long", "text": LONG, "label": 0},
                                                             {"id": "c", "text": "bad plot", "label": 0}]))
    argv = ["evaluate", where["bert"], str(data), "--out", str(tmp_path / "out"), "--methods", "logat,random"]
    monkeypatch.setattr(sys, "stderr", _Writes())
    assert main(argv) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["n"] == 2 and summary["failed"] == [
        {"index": 1, "id": "long", "error": "ValueError: the text is 102 tokens, but the model reads at most 64 "
                                            "(config.max_position_embeddings): shorten it"}]
    assert [r["id"] for r in map(json.loads, (tmp_path / "out" / "records.jsonl").read_text().splitlines())] == [
        "a", "c"]
    part = tmp_path / "out" / "parts" / "part-0.jsonl"
    before = part.read_bytes()
    assert "example 1 failed, recorded" in sys.stderr.text()
    # the page says so too: its figures count 2 examples, not the 3 of the data
    page = html.unescape((tmp_path / "out" / "report.html").read_text())
    assert ("1 example(s) failed and are in none of these figures (summary.json's failed lists each with its "
            "reason): example 1 (long): ValueError: the text is 102 tokens") in page
    monkeypatch.setattr(sys, "stderr", _Writes())
    assert main(argv) == 0
    assert part.read_bytes() == before and "failed, recorded" not in sys.stderr.text()  # not retried


def test_a_mistyped_folder_name_is_said_to_be_neither_a_folder_nor_a_hub_model(where, tmp_path):
    """A bare name that is no folder here is looked up on the hub: the line says both (it gave the hub's answer
    alone, "couldn't connect to huggingface.co", for a folder name typed wrong), and names the folder it looked in."""
    import subprocess
    import sys

    shutil.copytree(where["bert"], tmp_path / "sentiment")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([sys.executable, "-m", "nxl_hooks", "attribute", "sentimnet", TEXT], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"nxl attribute: error: sentimnet: no folder of that name in {tmp_path}, and the hub gave "
                           "no model by that id (") and line.endswith("check the name, or give a folder's path"), line


def test_docs_state_the_catalogue():
    """The figures in docs/testing.md are the collected catalogues: the library's and the command line's, every
    case a clear error (each test above asserts it)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "testing.md").read_text(encoding="utf-8")
    total = len(LIBRARY_CATALOGUE) + len(CLI_CATALOGUE)
    sentence = (r"(\d+) bad inputs \((\d+) to the library and files, (\d+) to the command line\): all (\d+) "
                r"give a clear error")
    found = re.search(sentence.replace(" ", r"\s+"), page)  # the page wraps its lines anywhere
    assert found, "docs/testing.md's bad-input figures are missing"
    expected = [total, len(LIBRARY_CATALOGUE), len(CLI_CATALOGUE), total]
    assert [int(n) for n in found.groups()] == expected, (
        f"docs/testing.md should say: {total} bad inputs ({expected[1]} to the library and files, {expected[2]} "
        f"to the command line): all {total} give a clear error")
    assert len(set(CLI_CATALOGUE)) == len(CLI_CATALOGUE)


def test_nxl_run_listen_on_a_port_in_use_is_refused_before_the_program_starts(tmp_path):
    """--listen on a port another program listens on (or an address this machine does not have): exit 2 and one
    line before the program starts. The program started, and its endpoint said so only in its log once it loaded a
    model, serving on its Unix socket alone (and nxl tail --run http://... reached the other program)."""
    import socket
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    program = ["--", sys.executable, "-c", "print('the program ran')"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for listen, message in ((f"127.0.0.1:{port}", f"port {port} is in use (another program listens there): "
                                 "pick a free port, or leave --listen out"),
                                ("192.0.2.1:8765", "cannot listen there (")):  # TEST-NET-1: no machine's address
            done = subprocess.run([sys.executable, "-m", "nxl_hooks", "run", "--listen", listen, "--allow-remote",
                                   *program], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 2 and "the program ran" not in done.stdout, (done.stdout, done.stderr)
            (line,) = done.stderr.strip().splitlines()
            assert line.startswith(f"nxl run: error: --listen {listen}: {message}"), line
