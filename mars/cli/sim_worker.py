"""``python -m mars.cli.sim_worker``: runs ``mars sim run`` for ``mars bench --sim``, one point
after another in one process.

Why: a simulated point is its own ``mars sim run`` (its own results folder, log, exit status),
and a fresh process for each spent ~13 s importing vLLM for 1-5 s of simulation on this
machine; a worker imports it once. Each point still runs exactly as the command would: the
same argument list through :func:`mars.cli.main`, ``sys.argv`` as ``python -m mars.cli``
sets it (results record their command), stdout and stderr (file descriptors 1 and 2, so
vLLM's and the simulator's own output too) into the point's log.

Protocol (:class:`mars.bench.workers.PointWorker` is the other end): one JSON object a line
on stdin, ``{"argv": [...], "log": PATH}``; one line back on the worker's original stdout,
``{"rc": N}``, when the point is over. End of input ends the worker. A point interrupted
(SIGINT, status 130) ends it too: the bench is stopping, and a simulation cut by a
``KeyboardInterrupt`` may leave state no next point should inherit.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _run(argv: list[str], log: str) -> int:
    from mars.cli import main as mars_main

    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py"),
                *argv]
    try:
        return int(mars_main(argv) or 0)
    except SystemExit as exc:  # argparse errors, a command's sys.exit
        code = exc.code
        if code is None or isinstance(code, int):
            return int(code or 0)
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mars: interrupted", file=sys.stderr)
        return 130
    except BaseException:  # noqa: BLE001 - a crash is the point's, reported in its log
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> int:
    answers = os.fdopen(os.dup(1), "w")  # before fd 1 becomes a point's log
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            job = json.loads(line)
            rc = _run(list(job["argv"]), str(job["log"]))
            answers.write(json.dumps({"rc": rc}) + "\n")
            answers.flush()
            if rc == 130:
                return 130
    except KeyboardInterrupt:  # between points: the bench is stopping
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
