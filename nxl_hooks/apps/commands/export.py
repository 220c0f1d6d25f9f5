"""``nxl export RUN_DIR_OR_STREAM out.parquet``: stream records as tidy Parquet rows, for pandas or DuckDB.

    nxl export runs/ scores.parquet           # every stream file below runs/ (an nxl run folder)
    nxl export run.nxl scores.parquet         # one file written by attach(..., sink="run.nxl")

Columns: :mod:`nxl_hooks.records.parquet`. Needs ``pip install "nxl_hooks[parquet]"``.
"""

from __future__ import annotations

import argparse

from ..options import CliError

NAME = "export"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(NAME, help="write stream records as tidy Parquet rows (pandas, DuckDB)",
                            description="Read the stream files of a run folder (or one stream file) and write one "
                                        "Parquet row per call, step, layer and context position.")
    parser.add_argument("source", metavar="RUN_DIR_OR_STREAM", help="a run folder or a stream file")
    parser.add_argument("out", metavar="OUT.parquet", help="the Parquet file to write")
    parser.add_argument("--strict", action="store_true", help="refuse a damaged stream instead of exporting up to "
                                                              "the damage")
    return parser


def run(args: argparse.Namespace) -> int:
    from ...records.parquet import export_parquet
    from ...records.sink import read_stream

    try:
        import pyarrow  # noqa: F401 - checked before the records are read
    except ImportError:
        raise CliError('Parquet export needs pyarrow: pip install "nxl_hooks[parquet]"') from None
    calls = read_stream(args.source, strict=args.strict)
    rows = export_parquet(calls, args.out)
    damage = f"; damaged, read up to: {calls.damage.describe()}" if calls.damage else ""
    print(f"{args.out}: {rows} rows from {len(calls)} call(s){damage}")
    return 0
