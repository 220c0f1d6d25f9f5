"""``nxl export RUN_DIR_OR_STREAM out.parquet``: stream records as tidy Parquet rows, for pandas or DuckDB.

    nxl export runs/ scores.parquet           # every stream file below runs/ (an nxl run folder)
    nxl export run.nxl scores.parquet         # one file written by attach(..., sink="run.nxl")
    nxl export run.nxl scores.parquet --force # replace an existing scores.parquet (refused without --force)

Columns: :mod:`nxl_hooks.records.parquet`. Needs ``pip install "nxl_hooks[parquet]"``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import warnings

from ..options import CliError, named

NAME = "export"
_OTHER_FORMATS = {".html": "an HTML page", ".htm": "an HTML page", ".csv": "CSV", ".json": "JSON",
                  ".jsonl": "JSON lines", ".nxl": "a stream file", ".safetensors": "safetensors"}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(NAME, help="write stream records as tidy Parquet rows (pandas, DuckDB)",
                            description="Read the stream files of a run folder (or one stream file) and write one "
                                        "Parquet row per call, step, layer and context position.")
    parser.add_argument("source", metavar="RUN_DIR_OR_STREAM", type=named, help="a run folder or a stream file")
    parser.add_argument("out", metavar="OUT.parquet", help="the Parquet file to write")
    parser.add_argument("--strict", action="store_true", help="refuse a damaged stream instead of exporting up to "
                        "the damage (a torn last frame, where a killed writer stopped, is no damage: it is left out)")
    parser.add_argument("--force", action="store_true", help="replace OUT.parquet when it exists (by default an "
                                                             "existing file is left alone and the export refused)")
    return parser


def run(args: argparse.Namespace) -> int:
    from ...records.parquet import export_parquet, partial_path, pyarrow_module
    from ...records.reader import StreamDamageWarning, read_stream, stream_files
    from ..options import check_apart, check_output_file, one_line

    try:
        pyarrow_module()  # checked before the records are read
    except ImportError as err:
        raise CliError(str(err)) from None
    args.out = check_output_file(args.out, "OUT.parquet")
    if not os.path.exists(args.source):
        raise CliError(f"no stream file or run folder at {args.source}: give a file a sink wrote (attach(sink=...), "
                       "nxl attribute --generate --out) or the folder of nxl run --sink")
    streams = stream_files(Path(args.source))
    if not streams:
        raise CliError(f"{args.source} is a folder with no stream file (*.nxl) below it: give the folder of nxl run "
                       "--sink, or a stream file")
    check_apart("OUT.parquet", args.out, streams, writes=[args.out, partial_path(args.out)])
    # a name of another format the project writes was Parquet under that name, said nowhere (out.html opened as text)
    suffix = Path(args.out).suffix.lower()
    if suffix in _OTHER_FORMATS:
        raise CliError(f"OUT.parquet {args.out}: nxl export writes Parquet, not {_OTHER_FORMATS[suffix]}: name the "
                       "file .parquet (a page of a call is generation_html(call) in Python: docs/reading-results.md)")
    # The file is replaced whole at the end; an existing one may be anyone's (a typo, a table from elsewhere), and
    # Parquet is not ours to recognise, so only --force replaces it.
    if os.path.lexists(args.out) and not args.force:
        raise CliError(f"{args.out} exists: nxl export does not replace a file unless told to; pick a new name, or "
                       "add --force to replace it")
    with warnings.catch_warnings():  # the damage is said once, in the summary line below
        warnings.simplefilter("ignore", StreamDamageWarning)
        calls = read_stream(args.source, strict=args.strict)
    try:
        written = export_parquet(calls, args.out, replace_any=args.force)  # (--force: whatever is there)
    except OSError as err:
        raise CliError(f"writing {args.out} failed ({err.strerror or err}); nothing was written and no partial file "
                       "is left: free some space (or pick another folder) and export again") from None
    damage = ""
    # every file's, named: a torn end (its last frame, or its header: a file no record reached) is where a killed
    # writer stopped (no damage, --strict or not: read_stream), and must not hide the records another file lost
    for found in calls.damages:
        what = "torn, its end left out (a writer killed mid-write)" if found.torn else "damaged, read up to"
        damage += f"; {found.path}: {what}: {found.describe()}"
    said = ""
    if written.unexplained:
        said = (f"; {written.unexplained} call(s) not recorded, stopped early or with notes: why in the file's "
                "metadata nxl.calls (pyarrow.parquet.read_metadata)")
    # paths as any terminal prints them: a file's name may hold control characters, or bytes that are not UTF-8
    print(one_line(f"{args.out}: {written.rows} rows from {len(calls)} call(s){said}{damage}"))
    return 0
