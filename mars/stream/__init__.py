"""Transport for the unified information stream: a non-blocking publisher (engine side) and
subscribers (sidecar, ``mars events tail``). The schema lives in :mod:`mars.policy.events`."""

from mars.stream.publisher import EventPublisher
from mars.stream.subscriber import follow_jsonl, subscribe

__all__ = ["EventPublisher", "subscribe", "follow_jsonl"]
