"""``python -m mars.cli ...``: the ``mars`` command."""

import sys

from mars.cli import main

sys.exit(main())
