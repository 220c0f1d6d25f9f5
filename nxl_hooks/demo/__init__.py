"""The tiny sentiment classifier shipped for ``nxl demo`` (config.json, model.safetensors, tokenizer files
in this folder, written by ``examples/train_demo.py``) and its task generator, :mod:`nxl_hooks.demo.task`.

    model, tokenizer = nxl_hooks.apps.loading.load_model(str(nxl_hooks.demo.MODEL_DIR))
"""

from pathlib import Path

#: The folder holding the shipped demo model; ``from_pretrained(MODEL_DIR)`` loads it offline.
MODEL_DIR = Path(__file__).resolve().parent
