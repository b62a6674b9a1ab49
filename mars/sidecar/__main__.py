"""``python -m mars.sidecar``: the same as ``mars sidecar`` (what ``mars-vllm serve`` runs)."""

import sys

from mars.sidecar.cli import main

sys.exit(main())
