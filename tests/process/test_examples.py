"""The example scripts (examples/*.py) as a user runs them, in a fresh interpreter each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# train_demo.py with its training swapped for the untrained model (seconds, not the 15 s of training), which fails
# its check; run in a fresh interpreter: main() sets torch's threads to one for reproducible weights
_UNTRAINED = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("train_demo", sys.argv[1])
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)
def untrained(seed=0):
    tokenizer = demo.build_tokenizer(demo._DEMO_TEMPLATE)
    return demo.build_demo_model(len(tokenizer), seed).eval(), tokenizer
demo.train = untrained
sys.argv = ["train_demo.py", *sys.argv[2:]]
demo.main()
"""


def test_train_demo_saves_nothing_when_its_check_fails(tmp_path):
    """It saved the model (by default over the shipped demo model) before its check, so a failed run replaced it."""
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-c", _UNTRAINED, str(ROOT / "examples" / "train_demo.py"), "--out",
                           str(out), "--held-out", "50", "--min-rate", "1.01"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and "nothing saved" in done.stderr, done.stderr
    assert '"out": null' in done.stdout and not out.exists()
