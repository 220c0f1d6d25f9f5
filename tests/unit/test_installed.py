"""What ``nxl attach`` and ``nxl run``'s bootstrap name as the install of nxl_hooks: the source its distribution
was installed from (PEP 610 ``direct_url.json``), since no package index serves the name."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

from nxl_hooks.apps.serve.installed import BASE, install_line

REPO = Path(__file__).resolve().parents[2]


def _site(tmp_path: Path, direct: dict | None) -> Path:
    """A site-packages holding an nxl_hooks distribution installed from ``direct`` (None: from an index)."""
    info = tmp_path / "site" / "nxl_hooks-0.4.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nxl_hooks\nVersion: 0.4.0\n")
    if direct is not None:
        (info / "direct_url.json").write_text(json.dumps(direct))
    return info.parent


@pytest.mark.parametrize("kind", ["editable", "folder", "wheel", "vcs", "index", "wheel-removed"])
def test_the_install_line_names_the_source_nxl_hooks_came_from(tmp_path, kind):
    checkout = tmp_path / "my checkout"
    checkout.mkdir()
    wheel = tmp_path / "nxl_hooks-0.4.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    direct, expected = {
        "editable": ({"url": checkout.as_uri(), "dir_info": {"editable": True}}, f"'{checkout}'"),
        "folder": ({"url": checkout.as_uri(), "dir_info": {}}, f"'{checkout}'"),
        "wheel": ({"url": wheel.as_uri(), "archive_info": {}}, str(wheel)),
        "vcs": ({"url": "https://example.org/nxl_hooks.git", "vcs_info": {"vcs": "git", "commit_id": "abc"}},
                "git+https://example.org/nxl_hooks.git@abc"),
        "index": (None, "/path/to/nxl_hooks-checkout-or-wheel"),
        "wheel-removed": ({"url": (tmp_path / "gone.whl").as_uri(), "archive_info": {}},
                          "/path/to/nxl_hooks-checkout-or-wheel"),
    }[kind]
    line = install_line("/venv/bin/python", root=str(_site(tmp_path, direct)))
    assert line == f"/venv/bin/python -m pip install {expected}" and "\n" not in line


def test_a_checkout_run_in_place_is_its_own_source():
    assert install_line(sys.executable, root=str(REPO)) == f"{sys.executable} -m pip install {REPO}"


def test_the_base_modules_are_pyprojects_dependencies():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.match(r"[\w.-]+", spec).group(0) for spec in project["dependencies"]}
    # rich only prints the command line's tables: a program lent nxl_hooks records without it
    assert names == {*BASE, "tomli", "rich"} if "tomli" not in BASE else names == {*BASE, "rich"}
