"""``python -m fxpar``: the command line (see :mod:`fxpar.cli`)."""

import sys

from fxpar.cli import main

sys.exit(main())
