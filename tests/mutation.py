"""Mutation testing on demand (not part of CI): how many small, plausible bugs would the tests catch?

    pip install mutmut                                  # a well-kept mutation tester (3.x)
    python tests/mutation.py                            # every module of [tool.mutmut] in pyproject.toml
    python tests/mutation.py "nxl_hooks.eval.metrics*"  # only some mutants (mutmut's name globs)
    python tests/mutation.py --sample 10                # every 10th mutant of each module: a quicker estimate
    python tests/mutation.py --report                   # the last run's figures again, without running

mutmut copies the package to ``mutants/`` (git-ignored), makes one mutant per small change (an operator, a
constant, a comparison, a dropped argument...), and runs the tests that reach each mutated function until one
fails. What it mutates and which tests it runs are in ``[tool.mutmut]`` of pyproject.toml: the modules that
compute, record and compare (method/, records/ but html, hooks/forward.py, eval/metrics, audit, faithfulness),
checked by the in-process tests. Reruns reuse finished results; ``rm -rf mutants`` starts over.

The script prints one JSON object: mutants per status, the kill rate (killed / (killed + survived); timeouts and
segfaults count as killed, as mutmut counts them) overall and per module, the same with mutants that no selected
test reaches counted as survivors (``kill_rate_with_untested``), and the surviving mutants' names (``mutmut show
NAME`` prints one's diff: either a test is missing, or the mutant does not change behaviour).
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: mutmut's result words that mean a test failed on the mutant
KILLED = ("killed", "timeout", "segfault", "caught by type check")
_LINE = re.compile(r"^\s*(?P<name>[\w.]+__mutmut_\d+): (?P<status>.+?)\s*$")


def _mutmut(*args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH stays as the caller set it: mutmut puts mutants/ first and removes the original tree itself.
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=ROOT, text=True, capture_output=True)


def _statuses() -> dict[str, str]:
    """mutant name -> status ("not checked" before a run), as ``mutmut results --all true`` lists them."""
    listed = _mutmut("results", "--all", "true")
    if listed.returncode != 0:
        raise SystemExit(f"mutmut results failed:\n{listed.stdout}{listed.stderr}")
    return {m["name"]: m["status"] for m in map(_LINE.match, listed.stdout.splitlines()) if m}


def _module(name: str) -> str:
    return name.split(".x_")[0].split(".xǁ")[0]  # "pkg.mod.x_func__mutmut_3" / "pkg.mod.xǁClassǁmethod__mutmut_1"


def report(names: list[str] | None = None) -> dict:
    """Statuses of the mutants of the last run (``names``: only those), by module."""
    by_module: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    survivors = []
    wanted = None if names is None else set(names)
    for name, status in _statuses().items():
        if (wanted is not None and name not in wanted) or status == "not checked":
            continue
        by_module[_module(name)][status] += 1
        if status == "survived":
            survivors.append(name)

    def rate(counts: collections.Counter, *, untested: bool = False) -> float | None:
        killed = sum(counts[s] for s in KILLED)
        tested = killed + counts["survived"] + (counts["no tests"] if untested else 0)
        return round(killed / tested, 3) if tested else None

    total = sum(by_module.values(), collections.Counter())
    return {
        "mutants": sum(total.values()),
        "statuses": dict(total),
        "kill_rate": rate(total),
        "kill_rate_with_untested": rate(total, untested=True),
        "by_module": {module: {"mutants": sum(c.values()), "kill_rate": rate(c), **c}
                      for module, c in sorted(by_module.items())},
        "survived": survivors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutants", nargs="*", help="mutant name globs, e.g. 'nxl_hooks.eval.metrics*' (default: all)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count(), help="parallel test processes")
    parser.add_argument("--sample", type=int, metavar="K", help="only every K-th mutant of each module (an estimate)")
    parser.add_argument("--report", action="store_true", help="only report the last run")
    args = parser.parse_args(argv)
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print("mutation testing needs mutmut: pip install mutmut", file=sys.stderr)
        return 2
    names = list(args.mutants)
    if args.sample:
        if not (ROOT / "mutants").is_dir():  # mutants are listed once mutmut has generated them
            _mutmut("run", "--max-children", "1", "nxl_hooks.__no_such_mutant__*")
        by_module = collections.defaultdict(list)
        for name in sorted(_statuses()):
            if not names or any(fnmatch.fnmatch(name, pattern) for pattern in names):
                by_module[_module(name)].append(name)
        names = [name for group in by_module.values() for name in group[:: args.sample]]
    if not args.report:
        run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children),
                              *names], cwd=ROOT)
        if run.returncode != 0:
            print(f"mutmut run exited with {run.returncode}; its output is above", file=sys.stderr)
            return run.returncode
    print(json.dumps(report(names if args.sample else None), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
