"""``mars top``: a live view of a mars sidecar (model: :mod:`mars.top.model`, view: :mod:`mars.top.view`, command: :mod:`mars.cli.top`)."""
