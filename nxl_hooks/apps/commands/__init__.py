"""One module per ``nxl`` subcommand, each with ``NAME``, ``add_parser(sub)`` and ``run(args) -> int``.

Heavy imports (torch, transformers) happen inside ``run``, so ``nxl --help`` stays fast.
"""

from . import attribute, audit, convert, ctl, demo, evaluate, run, tail

#: The subcommands, in the order ``nxl --help`` lists them.
COMMANDS = (attribute, demo, evaluate, audit, run, tail, ctl, convert)
