"""No script injection (issue 12): hostile strings in every field a page shows (dataset ids, texts and labels,
token pieces, label names, model names, attribution metadata) stay text on every HTML page: the attribution
heatmap, the generation page, the evaluate report and the audit report, each made by the command line as a
user gets it.

Without a browser the pages are read with the stdlib HTML parser: no injected element or event attribute, no raw
hostile string, and each hostile string still shown (escaped). In headless Chromium (where installed) no payload
runs: each sets an attribute on <html> that the dumped DOM would show, and a control page without escaping
proves that it would.
"""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

import nxl_hooks as nxl
import tiny
from nxl_hooks.apps.cli import main
from test_browser import BROWSER, _chromium

RUN = "document.documentElement.dataset.pwned=1"  # what every payload tries to do: no space, comma or slash
#: one whitespace-free payload per token of the vocabulary (a word-level tokenizer splits at spaces)
TOKENS = [
    f"<script>{RUN}</script>",
    f'"><img/src=x/onerror={RUN}>',
    f"'><svg/onload={RUN}>",
    f"</script><script>{RUN}</script>",
    f"<!--<script>{RUN}//-->",
    f"</title></style><script>{RUN}</script>",
    f"javascript:{RUN}",
]
#: payloads for fields that may hold spaces: ids, texts, labels, model names
FIELDS = [f'"><img src=x onerror="{RUN}">', f"<svg onload={RUN}>", f"</script><script>{RUN}</script>"]
HOSTILE = TOKENS + FIELDS
VOCAB = tiny.VOCAB + TOKENS
TEXT = "the film was " + " ".join(TOKENS[:4])


def _save(path: Path, model: torch.nn.Module, template: str | None) -> Path:
    model.save_pretrained(path)
    tiny.word_tokenizer(VOCAB, template).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, str]:
    """name -> HTML of every page, made by `nxl` with hostile model folders, vocabularies, labels and data."""
    root = tmp_path_factory.mktemp("hostile")
    # model folders named by payloads: the name is the page title
    folder = root / FIELDS[0] / FIELDS[1]
    sizes = dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, pad_token_id=0)
    labels = {0: FIELDS[2], 1: TOKENS[1]}

    def classifier(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        config = BertConfig(**sizes, max_position_embeddings=64, id2label=labels,
                            label2id={v: k for k, v in labels.items()})
        return BertForSequenceClassification(config).eval()

    bert = _save(folder / "bert0", classifier(0), "[CLS] $A [SEP]")
    bert2 = _save(folder / "bert1", classifier(1), "[CLS] $A [SEP]")
    torch.manual_seed(0)
    llama = _save(folder / "llama", LlamaForCausalLM(LlamaConfig(**sizes, num_key_value_heads=2)).eval(), None)
    data = root / "data.jsonl"
    rows = [{"id": FIELDS[i % 3], "text": f"the film {TOKENS[i]} was good", "label": labels[i % 2],
             "evidence": [TOKENS[i]]} for i in range(len(TOKENS))]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    made = {"heatmap": root / "heatmap.html", "generation": root / "generation.html",
            "evaluate": root / "evaluate" / "report.html", "audit": root / "audit" / "report.html"}
    assert main(["attribute", str(bert), TEXT, "--target", FIELDS[2], "--html", str(made["heatmap"])]) == 0
    assert main(["attribute", str(llama), TEXT, "--generate", "3", "--html", str(made["generation"])]) == 0
    assert main(["evaluate", str(bert), str(data), "--out", str(made["evaluate"].parent),
                 "--methods", "random,logat,normxlogit"]) == 0
    assert main(["audit", "--reference", str(bert), "--candidate", str(bert2), str(data),
                 "--out", str(made["audit"].parent)]) == 0
    out = {name: path.read_text(encoding="utf-8") for name, path in made.items()}
    # the metadata of an attribution file (crafted: any string may be there)
    res = nxl.explain(tiny.build_model("bert"), tiny.tokenizer(), "the film was good")
    crafted = nxl.Attribution(**{**vars(res), "meta": {**res.meta, "model_class": FIELDS[0], "head_kind": FIELDS[1]}})
    out["metadata"] = crafted.to_html()
    return out


#: the <script> elements each page has of its own (the generation page: its data and its layer selector)
SCRIPTS = {"generation": 2}


@pytest.mark.parametrize("name", ["heatmap", "generation", "evaluate", "audit", "metadata"])
def test_hostile_strings_stay_text(pages, name):
    page = pages[name]
    found = tiny.elements(page, "script")
    assert len(found) == SCRIPTS.get(name, 0)
    for element in tiny.elements(page, "img") + tiny.elements(page, "svg"):
        assert element.get("class") == "nxl-chart"  # the report's own line charts, nothing injected
    events = [(e["tag"], k) for e in _all(page) for k in e if k.startswith("on") or (k in ("href", "src"))]
    assert events == []
    for hostile in HOSTILE:
        if "<" in hostile:
            assert hostile not in page
    body = page.split('<script type="application/json"')[0]
    shown = [h for h in HOSTILE if html.escape(h, quote=False) in body or html.escape(h) in body]
    assert shown, "the hostile strings should be shown, escaped"


def test_every_field_reaches_its_page(pages):
    """The test feeds what it claims: each page shows (escaped) the hostile strings of its fields."""
    def has(page: str, text: str) -> bool:
        return html.escape(text, quote=False) in page or html.escape(text) in page

    assert has(pages["heatmap"], TOKENS[0]) and has(pages["heatmap"], FIELDS[2])  # a token; the label explained
    assert has(pages["generation"], FIELDS[0]) and has(pages["generation"], TOKENS[3])  # the title; the prompt
    assert has(pages["evaluate"], FIELDS[0])  # the model's folder in the title
    assert has(pages["audit"], FIELDS[1]) and has(pages["audit"], f"the film {TOKENS[2]} was good")
    assert has(pages["audit"], repr(FIELDS[1]))  # a dataset id, as the example block quotes it
    assert has(pages["metadata"], FIELDS[0]) and has(pages["metadata"], FIELDS[1])
    data = re.search(r'<script type="application/json" id="nxl-data">(.*?)</script>', pages["generation"]).group(1)
    assert any(TOKENS[3] in row for row in json.loads(data)["columns"])  # the data block holds it, inert


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.found.append({"tag": tag, **dict(attrs)})


def _all(page: str) -> list[dict]:
    """Every start tag's name and attributes, in document order."""
    parser = _Tags()
    parser.feed(page)
    return parser.found


#: the harness's script: each page the srcdoc of a frame of its own (same origin: the harness reads the frame's
#: DOM); once every frame has loaded (the window's load waits for them) and virtual time has run on, it writes on
#: its own <html> how many frames it read and which of them a payload marked
_HARNESS = """
const pages = JSON.parse(document.getElementById("pages").textContent);
const frames = Object.keys(pages).map((name) => {
  const frame = document.createElement("iframe");
  frame.srcdoc = pages[name];
  document.body.appendChild(frame);
  return [name, frame];
});
window.addEventListener("load", () => setTimeout(() => {
  const read = frames.filter(([, frame]) => frame.contentDocument.documentElement !== null);
  document.documentElement.dataset.read = String(read.length);
  document.documentElement.dataset.pwned = read
    .filter(([, frame]) => frame.contentDocument.documentElement.dataset.pwned === "1").map(([name]) => name).join(",");
}, 1000));
"""


@pytest.mark.skipif(BROWSER is None, reason="no chromium on PATH: install it with `apt-get install -y chromium`")
def test_no_payload_runs_in_chromium(pages, tmp_path):
    """Every page in one Chromium (a start costs about a CPU-second), each in a frame of one harness page; two
    control pages without escaping prove that a payload would run there and be seen."""
    controls = {"control-field": f"<!DOCTYPE html><html><body><p>{FIELDS[0]}</p></body></html>",
                "control-token": f"<!DOCTYPE html><html><body><p>{TOKENS[0]}</p></body></html>"}
    framed = {**controls, **pages}
    data = json.dumps(framed).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    harness = tmp_path / "harness.html"
    harness.write_text(f'<!DOCTYPE html><html><body><script type="application/json" id="pages">{data}</script>'
                       f"<script>{_HARNESS}</script></body></html>", encoding="utf-8")
    dom = _chromium("--virtual-time-budget=3000", "--dump-dom", harness.as_uri())
    root = dict(re.findall(r'(data-[a-z]+)="([^"]*)"', re.search(r"<html([^>]*)>", dom).group(1)))
    assert root.get("data-read") == str(len(framed)), dom[:500]  # the harness read every frame
    assert root["data-pwned"].split(",") == list(controls)  # unescaped, a payload runs; on no page of ours
