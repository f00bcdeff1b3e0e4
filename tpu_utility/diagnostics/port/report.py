"""What ``port`` changed and left, with the texts of ``rules.py``: the report and the exit status."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..rules import RULES

EXIT_RUNS, EXIT_LEFT_BREAKS, EXIT_USAGE, EXIT_DOES_NOT_PARSE, EXIT_CHECK_FAILED = 0, 1, 2, 3, 4


@dataclass
class Change:
    """One rewrite: where, the code before and after, and the rule behind it."""

    rule: str
    where: str
    before: str
    after: str

    def __str__(self) -> str:
        why = RULES[self.rule].cost if self.rule in RULES else "the rewrites above use it"
        return f"  {self.where}: {self.before} -> {self.after}\n      why: {why}"


@dataclass
class Left:
    """A line the port kept that still costs speed or breaks on XLA, with the fix."""

    rule: str
    where: str
    code: str
    fix: str

    def __str__(self) -> str:
        return f"  {self.where}: {self.code}\n      [{self.rule}] {RULES[self.rule].cost}\n      fix: {self.fix}"


@dataclass
class PortReport:
    """What ``port`` changed, what it left, and what it could not read."""

    source: str
    output: str | None = None
    changes: list[Change] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    untouched: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # code that does not parse: where, why; nothing ported there
    ran: str = "not run: ported only (python -m tpu_utility.port runs its first steps)"  # the run's word (port/check.py)

    def host_syncs(self) -> list[Left]:
        return [item for item in self.left if item.rule == "host_sync"]

    def breaking(self) -> list[Left]:
        """What was left that stops the program on XLA or makes it compute something else there."""
        return [item for item in self.left if RULES[item.rule].breaks]

    def status(self) -> int:
        """The command's exit status: 0 expected to run unchanged, 1 lines left that break, 3 does not parse."""
        return EXIT_DOES_NOT_PARSE if self.failed else EXIT_LEFT_BREAKS if self.breaking() else EXIT_RUNS

    def summary(self) -> str:
        changed = len({c.where for c in self.changes if c.rule != "imports"})
        left, breaking = len({i.where for i in self.left}), len({i.where for i in self.breaking()})
        verdict = {EXIT_RUNS: f"{self.ran}; what is left only costs speed" if self.ran.startswith("yes") else (
                       f"{self.ran}; the port left nothing that stops it"),
                   EXIT_CHECK_FAILED: f"{self.ran}",
                   EXIT_LEFT_BREAKS: f"no: {breaking} line(s) left stop it or change what it computes on XLA",
                   EXIT_DOES_NOT_PARSE: "no: part of the input does not parse, and nothing was ported there"}  # fmt: skip
        status = self.exit_status()
        return (f"summary: {changed} line(s) changed, {left} left; expected to run unchanged on XLA: "
                f"{verdict[status]} (exit {status})")

    def exit_status(self) -> int:
        """The command's exit status once the run (if any) is known: 4 where the port's output ran and failed."""
        return EXIT_CHECK_FAILED if self.status() == EXIT_RUNS and self.ran.startswith("no:") else self.status()

    def text(self) -> str:
        lines = [f"tpu_utility.port: {self.source} -> {self.output or '(diff only, nothing written)'}"]
        if self.failed:
            lines.append(f"does not parse ({len(self.failed)}): left as it is, nothing ported there")
            lines += [f"  {f}" for f in self.failed]
        lines.append(f"changed ({len(self.changes)}):")
        lines += [str(c) for c in self.changes] or ["  nothing"]
        lines.append(f"left as written ({len(self.left)}): still slow or wrong on XLA")
        lines += [str(item) for item in self.left] or ["  nothing"]
        if self.untouched:
            lines.append(f"not Python, passed through untouched ({len(self.untouched)}):")
            lines += [f"  {u}" for u in self.untouched]
        lines.append(self.summary())
        return "\n".join(lines)

    def add(self, change: Change) -> None:
        """Records a change; one that contains an earlier one on its line (an inner rewrite) replaces it."""
        self.changes = [c for c in self.changes if not (c.where == change.where and c.before in change.before)]
        self.changes.append(change)

    def sort(self) -> None:
        """Changes and lines left in the order of the input (cell, line); on one line, in the order found."""
        self.changes.sort(key=lambda c: _order(c.where))
        self.left.sort(key=lambda item: _order(item.where))


def _order(where: str) -> tuple[int, int]:
    import re

    numbers = [int(n) for n in re.findall(r"\d+", where)]
    return (numbers[0], numbers[1]) if len(numbers) > 1 else (0, numbers[0] if numbers else 0)


def short(code: str, limit: int = 100) -> str:
    """Code on one line without its comments, cut to ``limit`` characters."""
    one = " ".join(" ".join(line for line in code.splitlines() if not line.strip().startswith("#")).split())
    return one if len(one) <= limit else one[: limit - 3] + "..."
