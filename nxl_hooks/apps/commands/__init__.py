"""One module per ``nxl`` subcommand, each with ``NAME``, ``add_parser(sub)`` and ``run(args) -> int``.

Heavy imports (torch, transformers) happen inside ``run``, so ``nxl --help`` stays fast.
"""

from . import attach, attribute, audit, convert, ctl, demo, detach, evaluate, export, run, tail

#: The subcommands, in the order ``nxl --help`` lists them.
COMMANDS = (attribute, demo, evaluate, audit, run, tail, ctl, attach, detach, export, convert)
