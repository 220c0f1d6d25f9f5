"""``python -m nxl_hooks ...`` is the ``nxl`` command (also under ``accelerate launch -m nxl_hooks``)."""

import sys

from nxl_hooks.apps.cli import main

sys.exit(main())
