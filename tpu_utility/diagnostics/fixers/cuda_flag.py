"""The GPU chosen by a flag (``--cuda``, ``--no-cuda``, ``use_cuda``, ``--accel``): after the port the accelerator is the default.

``if opt.cuda: netD.cuda()`` moves nothing without the flag, so the port tests the device
instead (``get_device().type != "cpu"``: the same as no flag on the CPU). A
``use_cuda = not args.no_cuda and torch.cuda.is_available()`` that decides other settings is
named in the report. pytorch/examples' 2025 scripts spell the flag ``--accel`` (``if args.accel: device =
torch.accelerator.current_accelerator()``, off by default), and dcgan's current form tests it with
the accelerator (``if opt.accel and torch.accelerator.is_available():``): the same, the flag's part of
the test dropped and said. An opt-out (``--no-cuda``, ``--no-accel``: ``use_accel = not args.no_accel and
torch.accelerator.is_available()``) is the user's explicit choice and is kept: ``if use_accel:`` stays
where its assignment is ported (the accelerator's test). Where CUDA's test is left there (it guards loader
settings too), ``if use_cuda:`` around the device becomes ``if not args.no_cuda and get_device().type !=
"cpu":``, and ``torch.device("cuda" if use_cuda else "cpu")`` keeps the flag (``device_strings``).
A flag whose name says neither word (``train_on_gpu = torch.cuda.is_available()``, the Udacity course
notebooks; then ``if train_on_gpu: model.cuda()``) is the availability test itself: its value becomes the
accelerator's test where an ``if`` on the name moves to the GPU or picks the device.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, analysis, fixes, opening
from .tree import DECIDES_DEVICE, code, dotted, libcst


_FLAG_WORDS = ("cuda", "accel")  # args.cuda, use_cuda; args.accel, use_accel


def _is_flag(test: Any) -> bool:
    cst = libcst()
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return False  # `if not args.cuda:` keeps the CPU branch: left alone
    name = dotted(test)
    return bool(name) and any(word in name.rsplit(".", 1)[-1] for word in _FLAG_WORDS) and not name.startswith("torch.")


_AVAILABLE = ("torch.cuda.is_available()", "torch.accelerator.is_available()", 'get_device().type != "cpu"')


def _opt_in(test: Any) -> bool:
    """``opt.accel and torch.accelerator.is_available()``: an opt-in flag and the availability test, nothing else."""
    cst = libcst()
    if not (isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And)):
        return False
    sides = (test.left, test.right)
    return any(_is_flag(s) for s in sides) and any(code(s).strip() in _AVAILABLE for s in sides)


def _opt_out(test: Any) -> str | None:
    """``not args.no_accel``'s code where ``test`` is ``not <x>.no_...`` (an opt-out), else None."""
    cst = libcst()
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        name = dotted(test.expression)
        if name and name.rsplit(".", 1)[-1].startswith("no_") and any(w in name for w in _FLAG_WORDS):
            return code(test)
    return None


@analysis(order=80)
def analyse(module: Any, plan: Any) -> None:
    """``plan.opt_outs``: ``use_accel = not args.no_accel and <available>`` -> ``{"use_accel": "not args.no_accel"}``."""
    cst = libcst()

    class Flags(cst.CSTVisitor):
        def visit_Assign(self, node: Any) -> None:
            test = node.value
            if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And) and any(
                    a in code(test) for a in _AVAILABLE[:2]):  # fmt: skip
                out = _opt_out(test.left) or _opt_out(test.right)
                if out:  # "" where the port makes the availability test the accelerator's: the name is then right
                    out = out if "torch.cuda.is_available()" in code(test) else ""
                    plan.opt_outs.update({dotted(t.target): out for t in node.targets if dotted(t.target)})

        def visit_If(self, node: Any) -> None:
            name = dotted(node.test)
            if name and not _is_flag(node.test) and DECIDES_DEVICE.search(code(node.body)):
                plan.device_tests.add(name)

    module.visit(Flags())


def _availability(node: Any) -> bool:
    """``torch.cuda.is_available()`` or ``True if torch.cuda.is_available() else False``."""
    cst = libcst()
    if isinstance(node, cst.IfExp) and code(node.body).strip() == "True" and code(node.orelse).strip() == "False":
        node = node.test
    return code(node).strip() == _AVAILABLE[0]


@opening
def opens(node: Any) -> bool:
    """Whether an ``if`` tests a CUDA flag (alone or with the availability test) and moves to the GPU or picks the device."""
    return (_is_flag(node.test) or _opt_in(node.test)) and bool(DECIDES_DEVICE.search(code(node.body)))


@fixes("If", order=40)
def fix_if(porter: Porter, original: Any, updated: Any) -> Any:
    """``if opt.cuda:`` around a move to the GPU, or ``if use_cuda:`` around the device line -> ``if get_device().type != "cpu":``."""
    if not opens(original):
        return None
    out = porter.plan.opt_outs.get(dotted(original.test))
    if out == "":
        return None  # use_accel = not args.no_accel and torch.accelerator.is_available(), ported: it holds as it is
    porter.need("get_device")
    test = libcst().parse_expression(f'{out + " and " if out else ""}get_device().type != "cpu"')
    porter.change("flag_opt_out" if out else "cuda_flag", original.test, test)
    return updated.with_changes(test=test)


@fixes("Assign", order=50)
def fix_assign(porter: Porter, original: Any, updated: Any) -> Any:
    """``use_cuda = not args.no_cuda and torch.cuda.is_available()``: reported, the device line is ported."""
    cst = libcst()
    targets = [dotted(t.target) for t in original.targets]
    if _availability(original.value) and any(t in porter.plan.device_tests for t in targets):
        porter.need("get_device")
        new = cst.parse_expression('get_device().type != "cpu"')
        porter.change("cuda_flag", original.value, new)
        return updated.with_changes(value=new)
    if (isinstance(original.value, cst.BooleanOperation) and "torch.cuda.is_available()" in code(original.value)
            and any("cuda" in t for t in targets)):  # fmt: skip
        porter.leave_alone("cuda_flag_settings", original)
    return None
