"""Process-environment settings that must be in place before the SDK is imported."""

from __future__ import annotations

import os

#: set before importing openhands/litellm (setdefault: an explicit setting wins)
SDK_ENV = {
    # LiteLLM otherwise downloads a model price list at import; offline, concurrent
    # workers crash on it
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "OPENHANDS_SUPPRESS_BANNER": "1",
}


def prepare_sdk_env() -> None:
    for key, value in SDK_ENV.items():
        os.environ.setdefault(key, value)


def sdk_available() -> bool:
    """True when the OpenHands SDK can be imported here (without importing it)."""
    import importlib.util

    try:
        return (importlib.util.find_spec("openhands.sdk") is not None
                and importlib.util.find_spec("openhands.tools") is not None)
    except (ImportError, ValueError):
        return False
