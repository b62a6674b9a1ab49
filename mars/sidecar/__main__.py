"""``python -m mars.sidecar``: the same as ``mars sidecar`` (what ``mars-vllm serve`` runs)."""

import sys

from mars.cli.sidecar import main

sys.exit(main())
