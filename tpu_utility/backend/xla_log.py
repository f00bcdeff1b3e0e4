"""XLA's C++ log lines that repeat once per compiled graph, said once.

An SPMD or ``strategy="fsdp"`` run compiles each graph through GSPMD, and XLA's C++ logs
"GSPMD sharding propagation is going to be deprecated ..." for every one: about a hundred
lines on a TPU, between which the package's own lines are lost. The line is XLA's notice of
its future partitioner (Shardy); nothing in the run can act on it. C++ writes it straight to
file descriptor 2, below Python's ``warnings``, so it can only be filtered there:
``say_once()`` puts a pipe in front of the process's stderr whose reader passes every byte on
at once and drops the repeats of these lines (the first is kept, marked as said once).
Everything else, Python's tracebacks included, passes unchanged; at exit the pipe is drained.

Example:
    >>> say_once()    # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import os
import re
import select
import threading

REPEATED = (b"GSPMD sharding propagation is going to be deprecated",)
_LOG_LINE_START = re.compile(rb"^\d[\d\-: .]*$")  # a C++ log line's timestamp, its line not yet whole
_started: list[int] = []


def say_once() -> None:
    """Filters XLA's once-per-graph lines (``REPEATED``) on this process's stderr to their first; once per process."""
    if _started:
        return
    try:
        read, write = os.pipe()
        try:  # room for a burst written while the GIL is held elsewhere (Linux; 64 KiB otherwise)
            import fcntl

            fcntl.fcntl(write, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except (ImportError, OSError):
            pass
        original = os.dup(2)
        os.dup2(write, 2)
        os.close(write)
    except OSError:  # no stderr to stand in front of: nothing to filter
        return
    _started.append(original)
    pump = threading.Thread(target=_pump, args=(read, original), name="tpu_utility-xla-log", daemon=True)
    pump.start()

    def drain() -> None:  # the last lines (a traceback) reach the console before the process ends
        os.dup2(original, 2)
        pump.join(timeout=2)

    atexit.register(drain)


def _pump(read: int, original: int) -> None:
    try:
        _filter(read, original)
    except OSError:  # the console is gone: stderr goes back to it as it was, the pipe closed (no writer blocks)
        os.dup2(original, 2)
    finally:
        os.close(read)


def _filter(read: int, original: int) -> None:
    seen: set[bytes] = set()
    held = b""
    while True:
        ready, _, _ = select.select([read], [], [], 0.2 if held else None)
        if not ready:  # a partial line that stays partial: not a log line, pass it on
            os.write(original, held)
            held = b""
            continue
        chunk = os.read(read, 65536)
        if not chunk:
            os.write(original, held)
            return
        *lines, held = (held + chunk).split(b"\n")
        out = []
        for line in lines:
            kind = next((r for r in REPEATED if r in line), None)
            if kind is None:
                out.append(line + b"\n")
            elif kind not in seen:
                seen.add(kind)
                out.append(line + b" (said once: tpu_utility leaves out its repeats, one per compiled graph)\n")
        if held and not _LOG_LINE_START.match(held[:64]):  # a progress bar's \r update: at once
            out.append(held)
            held = b""
        if out:
            os.write(original, b"".join(out))
