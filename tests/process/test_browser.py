"""The HTML pages in a real headless browser: the DOM Chromium builds keeps every heatmap cell and plot point
with the right values, and the rendered pixels show the heatmap colours.

Needs Debian's chromium (``apt-get install -y chromium``); skipped with that reason when it is absent.
"""

import os
import re
import shutil
import subprocess
import tempfile

import pytest

import tiny
from test_viz import (  # noqa: F401  (explained and generation are fixtures)
    assert_heatmap_matches,
    evaluate_page,
    explained,
    generation,
    generation_cells_match,
)

BROWSER = next(
    (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None
)
pytestmark = pytest.mark.skipif(
    BROWSER is None, reason="no chromium on PATH: install it with `apt-get install -y chromium`"
)


def _chromium(*args: str) -> str:
    # The network is closed here: without the background-networking flags Chromium keeps trying to reach Google.
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run(
            [
                BROWSER,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=90,
            env={**os.environ, "HOME": profile},
        )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_heatmap_dom_in_chromium_has_every_cell_with_oracle_values(explained, tmp_path):  # noqa: F811
    res, expected, mask = explained
    path = tmp_path / "heatmap.html"
    res.to_html(path)
    dom = _chromium("--dump-dom", path.as_uri())
    assert "<table" in dom and "nxl-heatmap" in dom
    assert_heatmap_matches(dom, expected, mask)


def test_report_plots_in_chromium_dom_and_pixels(tmp_path):
    page, summary = evaluate_page()
    path = tmp_path / "report.html"
    path.write_text(page)
    dom = _chromium("--dump-dom", path.as_uri())
    points = tiny.elements(dom, "circle", "nxl-point")
    curve = summary["methods"]["normxlogit"]["comprehensiveness_curve"]
    ks = len(summary["ks"])
    assert [float(p["data-y"]) for p in points[ks : 2 * ks]] == curve
    assert len(tiny.elements(dom, "svg", "nxl-chart")) >= 2

    image = pytest.importorskip("PIL.Image", reason="Pillow is needed to read the screenshot")
    shot = tmp_path / "report.png"
    _chromium("--window-size=1100,1400", "--hide-scrollbars", f"--screenshot={shot}", path.as_uri())
    pixels = {colour for _, colour in image.open(shot).convert("RGB").getcolors(maxcolors=1 << 24)}
    assert (31, 119, 180) in pixels and (214, 39, 40) in pixels  # the first two series' line colours were painted
    assert len(pixels) > 50  # not a blank page


def test_generation_page_layer_selector_in_chromium(generation, tmp_path):  # noqa: F811
    page, _, expected = generation
    path = tmp_path / "generation.html"
    path.write_text(page, encoding="utf-8")
    generation_cells_match(_chromium("--dump-dom", path.as_uri()), expected, -1)  # as written: the last layer
    for layer in (0, 2):  # the script picks the layer the address names, and recolours every cell
        dom = _chromium("--dump-dom", f"{path.as_uri()}#layer={layer}")
        generation_cells_match(dom, expected, layer)


def test_generation_page_shows_the_users_words_on_screen_at_1400_px(tmp_path):
    """Issue 24 item 12: with a system prompt the template's columns are folded away, so the first word of the
    user's message is on screen in a 1400 px wide window (Chromium lays the page out; a script reads where)."""
    from test_chat_ranking import QUESTION, flat_world

    from nxl_hooks.apps.cli import main

    folder, _, _ = flat_world(tmp_path / "hf")
    page = tmp_path / "gen.html"
    assert main(["attribute", str(folder), QUESTION, "--chat", "--generate", "3", "--layers", "last",
                 "--html", str(page)]) == 0
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", """<script>
      var th = Array.prototype.find.call(document.querySelectorAll("#nxl-generation thead th"),
                                         function (h) { return / The$/.test(h.textContent); });
      var r = th.getBoundingClientRect();
      document.body.setAttribute("data-probe", [r.left, r.right, th.offsetParent !== null].join(","));
    </script></body>"""), encoding="utf-8")
    dom = _chromium("--window-size=1400,900", "--dump-dom", probe.as_uri())
    left, right, shown = dom.split('data-probe="')[1].split('"')[0].split(",")
    assert shown == "true" and 0 <= float(left) < float(right) <= 1400


def test_generation_page_script_writes_numbers_as_python_does(generation, tmp_path):  # noqa: F811
    """The cells' text and tooltips read as Python writes them: fmt() (%.3g, %.1e below 1e-3) and %.6g, exponents
    of two digits, on a layer the script writes (the first, opened as page.html#layer=0); and the layer the page
    opens on keeps what Python wrote, an exact tie too (1.125: Python's "1.12", the script's rounding "1.13")."""
    import json

    page, _, _ = generation
    head, rest = page.split('id="nxl-data">')
    block, tail = rest.split("</script>", 1)
    data = json.loads(block)
    chosen = [1460.0, -1460.0, 1e-4, -2.5e-5, 0.000999, 0.001, 123.4, 999.6, 1e5, 0.0, 0.1, 12.0, 100.0,
              1234567.0, 0.0123, -0.5, 1.5, 2e-9, 123456789.0, 0.00012345]
    n = 0
    for row in data["values"]:
        for j, v in enumerate(row[0]):
            if v is not None:
                row[0][j] = chosen[n % len(chosen)]
                n += 1
    assert n >= len(chosen) and len(data["layers"]) > 1
    # one last-layer cell as Python writes an exact tie: its value in the data block and its text in the table
    i, j = next((i, j) for i, row in enumerate(data["values"]) for j, v in enumerate(row[-1]) if v is not None)
    data["values"][i][-1][j] = 1.125
    cell = re.compile(rf'(<td class="nxl-cell[^"]*" data-row="{i}" data-col="{j}" data-value=")[^"]*(" title="[^"]*: )'
                      r'[^"]*(" [^>]*>)[^<]*(</td>)')
    head, count = cell.subn(lambda m: f"{m[1]}1.125{m[2]}{1.125:.6g}{m[3]}{1.125:.3g}{m[4]}", head)
    assert count == 1
    path = tmp_path / "numbers.html"
    path.write_text(head + 'id="nxl-data">' + json.dumps(data).replace("<", "\\u003c") + "</script>" + tail,
                    encoding="utf-8")

    def shown(fragment: str) -> list[tuple[dict, str]]:
        dom = _chromium("--dump-dom", path.as_uri() + fragment)
        cells = [(dict(re.findall(r'([\w-]+)="([^"]*)"', attributes)), text)
                 for attributes, text in re.findall(r'<td class="nxl-cell[^"]*"([^>]*)>([^<]*)</td>', dom)]
        return [(attributes, text) for attributes, text in cells if "data-value" in attributes]

    cells = shown(f"#layer={data['layers'][0]}")
    assert len(cells) == n
    for attributes, text in cells:
        v = float(attributes["data-value"])
        assert text == (f"{v:.3g}" if v == 0 or abs(v) >= 1e-3 else f"{v:.1e}"), (v, text)
        assert attributes["title"].endswith(f": {v:.6g}"), (v, attributes["title"])
    tie = [text for attributes, text in shown("") if attributes["data-row"] == str(i)
           and attributes["data-col"] == str(j)]
    assert tie == ["1.12"]


