"""The external control plane's policies (§4.2): see :mod:`mars.policy`."""
