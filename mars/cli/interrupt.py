"""A Ctrl-C that lands while a command is still starting (its modules importing, a server
being probed, tool workers spawning).

Python's default answer, a ``KeyboardInterrupt`` wherever the main thread happens to be,
interrupts start-up half-way: a replay killed there leaves no results and once left a
half-started tool pool hanging. :class:`EarlyInterrupt` notes the Ctrl-C instead; a command
that can stop gracefully (``mars replay``) takes the note over and stops the same way as after
a later Ctrl-C (partial results, exit 130); for any other command :meth:`release` raises the
``KeyboardInterrupt`` once the command is about to run. A second Ctrl-C is never held.
"""

from __future__ import annotations

import signal
import sys
import threading


class EarlyInterrupt:
    def __init__(self, prog: str = "mars") -> None:
        self.prog = prog
        self.pending = False
        self._old = None
        self._armed = False

    def __enter__(self) -> "EarlyInterrupt":
        # not off the main thread (signals go there), and not where Ctrl-C is ignored (a
        # background job of a script): nothing to hold there
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN):
            self._old = signal.signal(signal.SIGINT, self._note)
            self._armed = True
        return self

    def _note(self, signum, frame) -> None:  # noqa: ARG002
        if self.pending:  # a second Ctrl-C: give up now
            raise KeyboardInterrupt
        self.pending = True
        print(f"\n{self.prog}: interrupted while starting; stopping once started",
              file=sys.stderr, flush=True)

    def _restore(self) -> None:
        if self._armed:
            # None: the handler before was not set from Python; the default is what is left
            signal.signal(signal.SIGINT, self._old if self._old is not None
                          else signal.default_int_handler)
            self._armed = False

    def release(self) -> None:
        """Give Ctrl-C back to the handler before; one noted meanwhile is raised now."""
        self._restore()
        if self.pending:
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        self._restore()
