"""The internal scheduler's policies (§4.3): see :mod:`mars.policy`."""
