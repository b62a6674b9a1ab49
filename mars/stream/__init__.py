"""Transport for the unified information stream (paper §4.1): the engine's non-blocking
publisher (:mod:`~mars.stream.publisher`), the sidecar's event-loop reader of it
(:mod:`~mars.stream.engine_reader`) and the subscribers of ``mars events tail``
(:mod:`~mars.stream.subscriber`). The schema lives in :mod:`mars.protocol.events`; the sidecar
merges engine, tool and control events (:mod:`mars.sidecar.hub`)."""

from mars.stream.publisher import EventPublisher
from mars.stream.subscriber import follow_jsonl, subscribe

__all__ = ["EventPublisher", "subscribe", "follow_jsonl"]
