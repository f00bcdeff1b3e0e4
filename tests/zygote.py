"""A warm interpreter for the suite's child scripts: torch, torch_xla, transformers and scikit-learn's datasets
imported once, then one ``fork`` per script, so a child starts in milliseconds instead of paying ~10 CPU-seconds
of imports.

Started by ``conftest.run_python`` (one per pytest worker, and one with ``--torch-only`` that imports torch
alone, for scripts that must not find torch_xla or transformers imported) and spoken to over its stdin/stdout, a JSON line
per request: ``{"code", "env", "cwd", "stdout", "stderr"}`` (or ``{"quit": true}`` at the end). For each it forks
a child and answers ``pid N`` at once and ``rc R S`` when the child ends (R as ``subprocess`` gives it: ``-signal`` for a signal; S the
child's CPU seconds).

The child becomes what ``python -c code`` would have been: a session of its own (the caller kills its whole
group on a timeout), the request's environment (with what the imports here set, where the request left those variables as
they were before the imports),
its working directory, ``sys.path`` and ``sys.argv`` of ``-c``, a new empty ``__main__``, stdin from
/dev/null and stdout/stderr into the given files. Nothing here starts a runtime: the imports start no XLA
client, so each child starts its own, as a fresh interpreter does. The child's end unwinds out of this loop
(``SystemExit`` or the script's own exception), so the interpreter finishes as ``python -c`` does: atexit
handlers, thread joins and the exit status included. ``conftest.warm_start`` says which scripts may come
here, and to which of the two; those that test torch's own import or its environment keep a fresh interpreter.
"""

import gc
import json
import os
import sys
import types


def _preload(torch_only: bool) -> dict[str, tuple[str | None, str]]:
    """Imports what most child scripts import (torch alone with ``--torch-only``); returns what the imports set
    in the environment: {name: (before, after)}."""
    before = dict(os.environ)
    import torch  # noqa: F401

    if torch_only:
        return {k: (before.get(k), v) for k, v in os.environ.items() if before.get(k) != v}
    try:
        import torch_xla  # noqa: F401
        import torch_xla.core.xla_model  # noqa: F401
        import torch_xla.distributed.spmd  # noqa: F401
    except ImportError:  # the TorchTPU lane has no torch_xla
        pass
    try:
        import transformers  # noqa: F401
        from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401
    except ImportError:
        pass
    try:  # the digits of tpu_utility.demo, which about 40 child scripts train on: 2.6 CPU-s of import each
        import sklearn.datasets  # noqa: F401
    except ImportError:
        pass
    return {k: (before.get(k), v) for k, v in os.environ.items() if before.get(k) != v}


def _become(request: dict, imported_env: dict[str, tuple[str | None, str]], base_path: list[str]) -> None:
    """In the forked child: the process ``python -c request["code"]`` would have started; never returns."""
    os.setsid()
    os.environ.clear()
    os.environ.update(request["env"])
    for key, (before, after) in imported_env.items():  # as the imports would have set it from this environment
        if os.environ.get(key) == before:
            os.environ[key] = after
    os.chdir(request["cwd"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = ["", *extra, *base_path]
    sys.argv[:] = ["-c"]
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(request["code"], "<string>", "exec"), main.__dict__)
    raise SystemExit(0)


def main() -> None:
    zygote_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in zygote_path]  # sys.path[0]: this file's folder
    imported_env = _preload(torch_only="--torch-only" in sys.argv[1:])
    # the imports' objects moved out of the collector's reach: a child's exit then walks only its own (a child
    # that runs `pass` exits in 0.6 CPU-s, not 2.1, its last collection no longer touching every inherited page)
    gc.freeze()
    channel_in, channel_out = sys.stdin.buffer, sys.stdout.fileno()
    os.write(channel_out, b"ready\n")
    for line in channel_in:
        request = json.loads(line)
        if request.get("quit"):  # not the end of stdin: a process forked from the worker may hold its write end
            break
        pid = os.fork()
        if pid == 0:
            _become(request, imported_env, base_path)
        os.write(channel_out, f"pid {pid}\n".encode())
        _, status, usage = os.wait4(pid, 0)
        code, cpu = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        os.write(channel_out, f"rc {code} {cpu:.2f}\n".encode())


if __name__ == "__main__":
    main()
