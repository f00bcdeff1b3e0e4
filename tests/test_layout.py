"""The package's shape, checked: layers that only import downwards, and one package that talks to torch_xla."""

import ast
import os

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "tpu_utility")

# Modules of the package by dotted name, lowest layer first: a module imports only from its own layer or
# lower ones, so the backend never learns about training, the kit never about the trainer, and data
# preparation never about the loop that consumes it. "data" and "training" are those packages' __init__.
# Inside the backend the same holds module by module: what every backend answers and the probes, then the
# backends, TorchTPU over the native one, then the choice and the functions that delegate to it.
LAYERS = [
    {"backend.base", "backend.hardware", "backend.versions", "backend.choice", "backend.xla_log"},
    {"backend.native", "backend.xla"},
    {"backend.tpu"},
    {"backend.api"},
    {"backend", "diagnostics.rules"},
    {"arguments", "remote", "files", "progress", "device", "environment", "diagnostics.port", "diagnostics.fixers",
     "huggingface", "quantization", "scan"},
    {"optim", "sharding", "amp", "checkpoint", "compiler", "export", "data.buckets", "data.cache", "data.presize", "training.schedule",
     "training.optimizers", "training.topology", "training.precision",
     "training.monitor", "training.history", "training.graphs", "training.events", "training.strategies",
     "training.trace"},
    {"training.memory"},
    {"data.loaders", "data.packing", "training.metrics", "training.callbacks", "training.builtins", "training.agreement"},
    {"data", "loop", "training.throughput"},  # throughput reads token data's real lengths
    {"training.steps", "training.runner", "training.chunked"},  # the runner's rooms
    {"training.trainer", "training.inference", "training.generate", "diagnostics.doctor"},
    {"training.fit"},
    {"training.lr_finder", "training", "diagnostics.check", "diagnostics"},
    {"demo", "check", "port", "__init__"},
]  # fmt: skip
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _unit(parts):
    """The layer unit a dotted module belongs to: the longest known prefix (the backend package is one unit)."""
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in LAYER_OF:
            return name
    return None


def _modules():
    """(path, unit, package parts) for every module of the package."""
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
                package = parts[:-1]
                module = package if name == "__init__.py" else parts
                yield path, _unit(module) or ".".join(module) or "__init__", package


def _imported_names(source, package):
    """The package's dotted names a module's source imports, at the top or inside functions: relative imports
    resolved, absolute ones (``tpu_utility.x``) too; ``from a import b`` gives ``a.b`` (a module or a name in a)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            base += node.module.split(".") if node.module else []
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tpu_utility":
            base = node.module.split(".")[1:]
        elif isinstance(node, ast.Import):
            found.update(tuple(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "tpu_utility")
            continue
        else:
            continue
        found.update(tuple(base + [alias.name]) for alias in node.names)
    return found


def _imported_units(source, package):
    """The units a module's source imports, at the top or inside functions."""
    # a one-part name that is no unit is a name of the package's __init__ (``from .. import __version__``)
    return {_unit(list(parts)) or ("__init__" if len(parts) == 1 else None)
            for parts in _imported_names(source, package)} - {None}  # fmt: skip


def test_every_module_sits_in_a_layer():
    strays = sorted({unit for _, unit, _ in _modules() if unit not in LAYER_OF})
    assert not strays, f"modules in no layer (add them to LAYERS): {strays}"


def _upward(unit, source, package):
    return [other for other in _imported_units(source, package) if LAYER_OF[other] > LAYER_OF[unit]]


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{os.path.relpath(path, ROOT)} ({unit}) imports {other}"
        for path, unit, package in _modules() if unit in LAYER_OF
        for other in _upward(unit, open(path).read(), package)
    ]  # fmt: skip
    assert not upward, "\n".join(upward)


def test_the_layering_check_sees_upward_imports_at_any_depth():
    # the check itself can fail: files.py importing the trainer, and the data loaders importing the runner
    assert _upward("files", "def f():\n    from .training.fit import one_cycle_fit\n", []) == ["training.fit"]
    assert _upward("data.loaders", "from ..training import runner\nfrom .. import backend\n", ["data"]) == [
        "training.runner"
    ]
    assert _upward("training.trainer", "from .runner import Runner\nfrom ..data.loaders import set_epoch\n",
                   ["training"]) == []  # fmt: skip
    assert _upward("backend.native", "def f():\n    from .api import naming_stalls\n", ["backend"]) == ["backend.api"]
    assert _upward("diagnostics.check", "def f():\n    from .. import __version__\n", ["diagnostics"]) == ["__init__"]


def _module_of(parts, modules):
    """The module an imported dotted name lands in: the longest prefix that is a module of the package."""
    for end in range(len(parts), -1, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _import_graph():
    """{module: the package's modules it imports}, module by module ("" is the package's __init__)."""
    sources = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, name), PACKAGE)[:-3].split(os.sep)
                package = parts[:-1]
                module = ".".join(package if name == "__init__.py" else parts)
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    sources[module] = (f.read(), package)
    return {
        module: {_module_of(list(p), sources) for p in _imported_names(source, package)} - {None, module}
        for module, (source, package) in sources.items()
    }


def _cycles(graph):
    """The import circles of a graph: each strongly connected set of two or more modules, sorted (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            members = []
            while not members or members[-1] != node:
                members.append(stack.pop())
                on_stack.discard(members[-1])
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_import_graph_has_no_circle():
    """No module imports one that imports it back, at the top or inside a function (a function-level import
    hides a circle from Python, not from a reader: backend/native.py imported backend/api.py, which imports it)."""
    assert _cycles(_import_graph()) == []


def test_the_circle_check_sees_a_circle_hidden_in_a_function():
    # the check itself can fail: a function-level import back up closes a circle through a third module
    graph = {"backend.api": {"backend.tpu", "backend.base"}, "backend.tpu": {"backend.native"}, "backend.base": set()}
    graph["backend.native"] = {_module_of(list(p), graph) for p in _imported_names(
        "def _replica_main():\n    from .api import naming_stalls\n", ["backend"])}  # fmt: skip
    assert _cycles(graph) == [["backend.api", "backend.native", "backend.tpu"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _imported_names("import tpu_utility.backend.api\nfrom tpu_utility.training import fit\n", []) == {
        ("backend", "api"), ("training", "fit")}  # fmt: skip


def test_the_backend_package_alone_imports_torch_xla_and_compares_device_types():
    offenders = []
    for path, unit, _ in _modules():
        if unit.split(".")[0] == "backend":
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                offenders += [f"{path}: import {n}" for n in names if n.split(".")[0] in ("torch_xla", "torch_tpu")]
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in ("xla", "tpu") for c in [node.left, *node.comparators]
            ):
                offenders.append(f"{path}:{node.lineno}: compares with a device type string")
    assert not offenders, "\n".join(offenders)


def _parameter_counts(source):
    """(class or None, function name, parameters besides self/cls) for every function of a module."""
    tree = ast.parse(source)
    owners = {id(f): c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [x.arg for x in (a.vararg, a.kwarg) if x]
            yield owners.get(id(node)), node.name, len([n for n in names if n not in ("self", "cls")])


def test_only_the_public_keyword_entries_take_more_than_six_parameters():
    import tpu_utility

    public = set(tpu_utility.__all__)
    crowded = [
        f"{os.path.relpath(path, ROOT)}: {owner + '.' if owner else ''}{name} takes {count}"
        for path, _, _ in _modules()
        for owner, name, count in _parameter_counts(open(path).read())
        if count > 6 and not (name in public or (name == "__init__" and owner in public))
    ]  # fmt: skip
    assert not crowded, "group them in a dataclass or let the caller build the object:\n" + "\n".join(crowded)
    source = "class Plan:\n    def __init__(self, a, b, c, d, e, f, g): pass\ndef _helper(a, b, *, c, d, e, f, g): pass\n"
    assert [count for _, _, count in _parameter_counts(source)] == [7, 7]  # the check can fail


def test_the_lanes_lists_name_test_files_that_exist():
    """A renamed or deleted file in conftest's lists would drop out of the Kaggle and Colab lanes unseen."""
    from conftest import HF_RELEASE, PYTHON_RELEASE, TORCH_RELEASE

    tests = {name for name in os.listdir(os.path.join(ROOT, "tests")) if name.startswith("test_")}
    listed = set(TORCH_RELEASE) | set(PYTHON_RELEASE) | set(HF_RELEASE)
    assert listed <= tests, f"listed but not in tests/: {sorted(listed - tests)}"
    assert all(TORCH_RELEASE.values()) and all(PYTHON_RELEASE.values()) and all(HF_RELEASE.values()), "each file says why"


def test_each_slow_test_conftest_explains_exists():
    """conftest.SLOW says why each slow test is where it is; a renamed test would leave a reason for nothing."""
    from conftest import SLOW

    for nodeid, why in SLOW.items():
        path, name = nodeid.split("::")
        with open(os.path.join(ROOT, "tests", path)) as f:
            assert f"def {name.split('[')[0]}(" in f.read(), nodeid
        assert "CPU-s" in why, nodeid  # what it costs, beside why


def test_no_function_in_diagnostics_is_longer_than_80_lines():
    """The porter, doctor and check stay readable: a long function is split (issue 40: a 305-line closure was)."""
    long = []
    for folder, _, files in os.walk(os.path.join(PACKAGE, "diagnostics")):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                long += [f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
                         for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and node.end_lineno - node.lineno + 1 > 80]  # fmt: skip
    assert not long, long


def test_every_fixer_module_registers_one_fixer_and_has_its_own_test():
    """One concern a module under diagnostics/fixers/: each registers itself (fixers/registry.py's decorators), no list
    names them by hand, and each is tested in test_fixers.py; the registry and tree.py are the helpers."""
    from tpu_utility.diagnostics import fixers

    folder = os.path.join(PACKAGE, "diagnostics", "fixers")
    modules = sorted(name[:-3] for name in os.listdir(folder) if name.endswith(".py") and name != "__init__.py")
    assert sorted(fixers.HELPERS) == ["registry", "tree"]
    assert sorted(fixers.REGISTRY) == [m for m in modules if m not in fixers.HELPERS], "a module that registers nothing"
    for name, fixer in fixers.REGISTRY.items():
        hooks = [f for _, f in fixer.fixes.values()] + [f for _, f in fixer.hooks.values()]
        assert hooks and {f.__module__ for f in hooks} == {f"tpu_utility.diagnostics.fixers.{name}"}
    with open(os.path.join(folder, "__init__.py"), encoding="utf-8") as f:
        init = ast.parse(f.read())
    by_hand = [a.name for n in ast.walk(init) if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module is None
               for a in n.names]  # fmt: skip
    assert by_hand == [], "fixers/__init__.py imports its modules by walking the folder"
    with open(os.path.join(ROOT, "tests", "test_fixers.py"), encoding="utf-8") as f:
        tests = f.read()
    assert [m for m in fixers.REGISTRY if f"def test_{m}_" not in tests] == []


def test_two_fixers_of_a_node_type_cannot_share_an_order():
    """The order the walk tries a node type's fixers in is explicit: a second fixer at a taken place is refused."""
    import pytest

    from tpu_utility.diagnostics.fixers import fixers_of, registry

    def fix_call(porter, original, updated):
        return None

    fix_call.__module__ = "tpu_utility.diagnostics.fixers.double"
    taken = registry.REGISTRY["host_sync"].fixes["Call"][0]
    with pytest.raises(ValueError, match="both ask for order"):
        registry.fixes("Call", order=taken)(fix_call)
    assert "double" not in registry.REGISTRY and fix_call not in fixers_of("Call")


def test_doctors_finding_kinds_are_read_from_the_rules_table_not_written_again():
    """doctor.Kind is the rules table's doctor rules (rules.DOCTOR_KINDS): a new rule is one entry, and a finding
    of a kind the table lacks is refused when it is made."""
    import importlib
    from typing import get_args

    import pytest

    from tpu_utility.diagnostics.rules import DOCTOR_KINDS, RULES_LIST

    doctor = importlib.import_module("tpu_utility.diagnostics.doctor")
    ids = tuple(rule.id for rule in RULES_LIST if "doctor" in rule.tools and not rule.part_of)
    assert get_args(doctor.Kind) == DOCTOR_KINDS == ids
    with open(doctor.__file__, encoding="utf-8") as f:
        (kind,) = [n for n in ast.parse(f.read()).body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "Kind"]
    assert [n.value for n in ast.walk(kind) if isinstance(n, ast.Constant)] == [], "Kind names the kinds again"
    with pytest.raises(ValueError, match="DOCTOR_KINDS"):
        doctor.Finding("host_syncs", "a typo of a kind", "")


def test_the_cost_and_fix_texts_are_written_only_in_rules():
    """doctor, check and port print their costs and fixes from diagnostics/rules.py; a copy elsewhere drifts."""
    import re

    from tpu_utility.diagnostics import rules

    texts = [t for rule in rules.RULES_LIST for t in (rule.cost, rule.fix)]
    texts += [*rules.MEASURED_FIXES.values(), *rules.LOWERED_REPLACEMENTS.values(), rules.COLLECT_ON_DEVICE]
    fragments = {part for text in texts for part in re.split(r"\{[^}]*\}", text) if len(part) >= 30}
    paths = [os.path.join(PACKAGE, name) for name in ("check.py", "port.py")]
    for folder, _, files in os.walk(os.path.join(PACKAGE, "diagnostics")):
        paths += [os.path.join(folder, name) for name in files if name.endswith(".py") and name != "rules.py"]
    copies = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        copies += [f"{os.path.relpath(path, ROOT)}: {part[:50]!r}" for part in fragments for s in strings if part in s]
    assert not copies, copies


def test_the_texts_check_finds_a_copy():
    """The check above sees a fix written twice (a test that cannot fail is a defect)."""
    from tpu_utility.diagnostics.rules import RULES

    copied = ast.parse(f"fix = {RULES['host_sync'].fix!r}")
    assert any(isinstance(n, ast.Constant) and RULES["host_sync"].fix in n.value for n in ast.walk(copied))


def _members(source, class_name):
    """A class's members in a module's source: its annotations, methods, and ``self.x = ...`` targets."""
    (cls,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == class_name]
    found = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    found |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    found.add(t.attr)
    return found - {"__init__"}


def test_the_trainers_loop_has_what_the_loop_protocols_promise_and_callbacks_are_typed_with_them():
    """events.Loop (a user's hooks) and events.TrainerLoop (the built-ins') list what trainer.Trainer holds."""
    with open(os.path.join(PACKAGE, "training", "events.py"), encoding="utf-8") as f:
        events = f.read()
    with open(os.path.join(PACKAGE, "training", "trainer.py"), encoding="utf-8") as f:
        trainer = f.read()
    promised = _members(events, "Loop") | _members(events, "TrainerLoop")
    assert {"model", "optimizer", "history", "step", "stop", "runner"} <= promised
    assert sorted(promised - _members(trainer, "Trainer")) == []
    assert _members("class Loop:\n    def __init__(self):\n        self.a, self.b = 1, 2\n", "Loop") == {"a", "b"}
    untyped = []
    for folder, _, files in os.walk(os.path.join(PACKAGE, "training")):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    untyped += [f"{name}:{n.lineno}" for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.arg)
                                and n.arg == "loop" and n.annotation is not None and ast.unparse(n.annotation) == "Any"]  # fmt: skip
    assert untyped == [], "type a callback's loop as events.Loop (or TrainerLoop for the built-ins): " + ", ".join(untyped)


# The XLA backend's groups' methods still allowed to be one call of a module function of xla.py: the FSDP/SPMD ones, which the
# sharded-training work (issue 'Models larger than one chip') is rewriting now; flatten them when it lands.
DELEGATION_EXEMPT = {"use_spmd", "shard_parameters"}


def _bare_delegations(source, class_name):
    """Methods of ``class_name`` whose body (docstring aside) is one call ``f(...)``, bare or returned, of a
    function defined at the top of the same module: a second layer with nothing of its own."""
    tree = ast.parse(source)
    module_functions = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    found = []
    for method in [n for n in cls.body if isinstance(n, ast.FunctionDef)]:
        body = method.body[1:] if ast.get_docstring(method) is not None else method.body
        if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)):
            continue
        call = body[0].value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in module_functions:
            found.append(method.name)
    return found


def test_the_xla_backends_methods_are_the_operations_not_a_layer_over_module_functions():
    """One place per XLA operation: a method holds the body, or is the module function itself (bound as a
    staticmethod) where other functions of xla.py use it too; never a method that only calls one."""
    with open(os.path.join(PACKAGE, "backend", "xla.py"), encoding="utf-8") as f:
        source = f.read()
    classes = ("XlaBackend", "XlaDevices", "XlaProcesses", "XlaCompute", "XlaDiagnosis", "XlaSharding")
    found = {name for cls in classes for name in _bare_delegations(source, cls)}
    assert sorted(found - DELEGATION_EXEMPT) == []
    layered = "def f(x):\n    return x\n\nclass B:\n    def a(self, x):\n        '''Doc.'''\n        return f(x)\n\n" \
              "    def b(self):\n        f(1)\n\n    def c(self):\n        return len([])\n"  # fmt: skip
    assert _bare_delegations(layered, "B") == ["a", "b"]  # the check sees a delegation (it can fail)


STRATEGY_WORDS = {"single", "spmd", "multiprocess", "fsdp", "multiprocess-fsdp", "replica"}


def _word_comparisons(source: str) -> list[int]:
    """Lines comparing a value with a strategy word (``mode == "spmd"``, ``word in ("auto", "fsdp")``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            literals = [c for side in sides for c in ([side] if isinstance(side, ast.Constant) else
                        getattr(side, "elts", []) if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [])]  # fmt: skip
            if any(isinstance(c, ast.Constant) and c.value in STRATEGY_WORDS for c in literals):
                lines.append(node.lineno)
    return lines


def _outside_strategies(lines_of):
    """``{file: lines}`` where ``lines_of(source)`` finds lines, in every module but strategies/ and the porter's
    (whose rules name user code's words and flags)."""
    found = {}
    for path, unit, _ in _modules():
        if unit == "training.strategies" or unit.startswith("diagnostics"):
            continue
        with open(path) as f:
            lines = lines_of(f.read())
        if lines:
            found[os.path.relpath(path, PACKAGE)] = lines
    return found


def test_no_code_outside_the_strategies_room_compares_a_strategy_word():
    """Callers ask the strategy object (launches, shards, in_job, topology()); only strategies/ reads the words."""
    found = _outside_strategies(_word_comparisons)
    assert not found, f"strategy words compared outside training/strategies/: {found}"
    assert _word_comparisons('if mode in ("single", "x"):\n    pass\nok = word != "fsdp"\n') == [1, 3]


STRATEGY_FLAGS = {"launches", "shards", "in_job", "may_shard", "replica"}  # what a strategy is, not what it does


def _flag_reads(source: str) -> list[int]:
    """Lines reading a strategy's flag (``chosen.shards``, ``plan.strategy.launches``, ``chosen.options``) or
    building ``Single()``: what callers would decide for the strategy instead of asking it."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in STRATEGY_FLAGS:
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "options":  # a Compile has options too: a strategy's
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            lines += [node.lineno] if owner in ("chosen", "strategy") else []
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Single":
            lines.append(node.lineno)
    return sorted(set(lines))


def test_no_code_outside_the_strategies_room_reads_a_strategy_flag_or_builds_single():
    """Callers hand the strategy the work (run, infer, one_program, alone, settled, column); only strategies/ reads
    what a strategy is, and only it decides when one device, alone, is the answer."""
    found = _outside_strategies(_flag_reads)
    assert not found, f"strategy flags read (or Single() built) outside training/strategies/: {found}"
    seen = "if chosen.launches:\n    x = Single()\ny = plan.strategy.in_job or chosen.options\nz = self.compile.options\n"
    assert _flag_reads(seen) == [1, 2, 3]  # the check sees each kind (it can fail)


def test_strategies_ask_the_backend_what_it_can_do_not_which_it_is():
    """No ``native`` flag reaches a strategy: each asks ``on.sharding.over_mesh()``."""
    import inspect

    from tpu_utility.training import strategies

    for kind in (strategies.Strategy, *strategies.STRATEGIES.values()):
        for name in ("choose", "for_job"):
            assert "native" not in inspect.signature(getattr(kind, name)).parameters, (kind, name)
    assert "native" not in inspect.signature(strategies.choose_strategy).parameters


def test_memory_plans_body_is_under_60_lines_its_columns_from_the_strategies():
    """The plan's figures per column come from strategies (held, checkpoints, gathered), not from FSDP written there."""
    path = os.path.join(PACKAGE, "training", "memory.py")
    with open(path) as f:
        source = f.read()
    plan = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "memory_plan")
    body = plan.body[1:] if isinstance(plan.body[0], ast.Expr) else plan.body  # its docstring aside
    assert body[-1].end_lineno - body[0].lineno + 1 < 60
    assert "shard_bytes(" not in ast.get_source_segment(source, plan) and ".held(" in ast.get_source_segment(source, plan)


def test_a_strategy_is_one_module_and_one_table_row(tmp_path, monkeypatch):
    """A tensor-parallel stub: one module (written here as a user would add it) and one row in STRATEGIES; the
    rest of the package untouched, one_cycle_fit runs it (enter and leave called, its word on the summary line)."""
    import importlib
    import sys

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from tpu_utility import one_cycle_fit
    from tpu_utility.training import strategies

    (tmp_path / "tensor_parallel_stub.py").write_text(
        "from tpu_utility.training.strategies.base import Strategy\n"
        "class TensorParallel(Strategy):\n"
        "    name = 'tensor-parallel'\n"
        "    seen = []\n"
        "    def enter(self, model):\n"
        "        self.seen.append('enter')\n"
        "        self.note = 'tp: stub'\n"
        "    def leave(self, model):\n"
        "        self.seen.append('leave')\n"
    )  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    stub = importlib.import_module("tensor_parallel_stub")
    monkeypatch.setitem(strategies.STRATEGIES, "tp", stub.TensorParallel)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    history = one_cycle_fit(nn.Linear(4, 2), data, epochs=1, max_lr=1e-2, batch_size=8, strategy="tp", progress=False)
    assert stub.TensorParallel.seen == ["enter", "leave"], stub.TensorParallel.seen
    assert history.summary.startswith("one_cycle_fit: tensor-parallel on 1") and "tp: stub" in history.summary
    sys.modules.pop("tensor_parallel_stub", None)


GROUPS = ("devices", "processes", "compute", "diagnosis", "sharding")
MOST_METHODS = 15


def _public_methods(cls):
    """The methods a group answers, its own and inherited (dunders and privates aside)."""
    return sorted(name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name)))


def test_every_backend_holds_its_capabilities_in_small_groups():
    """A backend is a name, a device type and five groups of at most 15 methods each (issue 50: one class of 55
    methods and 46 delegators had grown); no question is asked of the backend object itself."""
    from tpu_utility.backend.base import Backend, Group
    from tpu_utility.backend.native import NativeBackend
    from tpu_utility.backend.tpu import TorchTpuBackend
    from tpu_utility.backend.xla import XlaBackend

    crowded, loose = [], []
    for kind in (Backend, NativeBackend, TorchTpuBackend, XlaBackend):
        for group in GROUPS:
            cls = getattr(kind, group.capitalize())
            assert issubclass(cls, Group), (kind, group)
            methods = _public_methods(cls)
            if len(methods) > MOST_METHODS:
                crowded.append(f"{kind.__name__}.{group}: {len(methods)} methods {methods}")
        loose += [f"{kind.__name__}.{name}" for name in _public_methods(kind) if name not in ("started",)
                  and not isinstance(getattr(kind, name), type)]  # fmt: skip
    assert not crowded, "split the group:\n" + "\n".join(crowded)
    assert not loose, f"a question asked of the backend object, not of a group: {loose}"
    assert isinstance(NativeBackend("cpu", "gloo").sharding, NativeBackend.Sharding)


def test_the_group_size_check_sees_a_crowded_group():
    crowded = type("Crowded", (), {f"m{i}": (lambda self: None) for i in range(MOST_METHODS + 1)})
    assert len(_public_methods(crowded)) == MOST_METHODS + 1


# api.py's functions, decided one by one (issue 50, item 4). The hand-loop kit's modules (re-exported as the kit by the
# package) call them; so may users. Outside the kit the package asks the group itself (``backend.current().devices.sync()``).
KIT_MODULES = ("loop", "device", "optim", "amp", "checkpoint", "sharding", "environment")
# The rest api.py keeps: which backend (the choice), what spans the backends rather than forwarding to one group, and the
# counters and clocks that tests/ and bench/ read as the public ``tpu_utility.backend`` API (docs/design.md names them).
API_PUBLIC = {
    "accelerator_type", "current", "ask", "why",  # the choice
    "is_master", "is_accelerated", "naming_stalls", "launch",  # span the backends or the groups
    "counters", "compile_count", "execute_count", "host_sync_count", "transfer_from_device_count", "fallback_ops",
    "clear_counters", "wait", "to_cpu",  # what tests and bench measure with
}  # fmt: skip


def _forwards(source):
    """The functions of a module whose body (docstring aside) is one call ``current().group.method(...)`` of its own
    parameters, bare or returned (``launch``, which wraps the function it hands on, is no forward)."""
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        call = body[0].value if len(body) == 1 and isinstance(body[0], (ast.Return, ast.Expr)) else None
        inner = getattr(getattr(getattr(call, "func", None), "value", None), "value", None)
        passed = [getattr(a, "id", None) for a in getattr(call, "args", [])] == [a.arg for a in node.args.args]
        if isinstance(call, ast.Call) and isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "current" \
                and passed:  # fmt: skip
            found.append(node.name)
    return found


def _backend_names(source):
    """The names a module reads off the backend package: ``backend.sync``, called or passed (``backends.`` in environment)."""
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id in ("backend", "backends")}  # fmt: skip


def _read(*parts):
    with open(os.path.join(PACKAGE, *parts), encoding="utf-8") as f:
        return f.read()


def test_api_keeps_only_the_kits_functions_the_choice_and_the_public_counters():
    api = ast.parse(_read("backend", "api.py"))
    functions = {n.name for n in api.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    used_by_kit = set().union(*(_backend_names(_read(f"{name}.py")) for name in KIT_MODULES))
    unowned = sorted(functions - used_by_kit - API_PUBLIC)
    assert not unowned, f"api.py functions no kit module calls and not in API_PUBLIC (ask the group instead): {unowned}"
    assert not API_PUBLIC - functions, f"API_PUBLIC names that api.py no longer has: {sorted(API_PUBLIC - functions)}"


def test_outside_the_kit_the_package_asks_the_group_not_a_one_line_forward():
    forwards = set(_forwards(_read("backend", "api.py")))
    kit = {os.path.join(PACKAGE, f"{name}.py") for name in KIT_MODULES}
    found = [
        f"{os.path.relpath(path, ROOT)}: backend.{name}" for path, _, _ in _modules()
        if path not in kit and os.sep + "backend" + os.sep not in path
        for name in sorted(_backend_names(open(path, encoding="utf-8").read()) & forwards)
    ]  # fmt: skip
    assert not found, "ask the group (backend.current().devices.sync()):\n" + "\n".join(found)
    # the check can fail: it sees a forward, and a use of one called or passed
    sample = "def sync(wait=False):\n    '''Doc.'''\n    current().devices.sync(wait)\n\ndef is_master():\n" \
             "    return current().processes.rank() == 0\n\ndef rank():\n    return current().processes.rank()\n\n" \
             "def launch(fn):\n    current().processes.launch(wrap(fn))\n"  # fmt: skip
    assert _forwards(sample) == ["sync", "rank"]
    assert _backend_names("backend.sync()\nf(backend.compile_count)\nbackend.current().devices.sync()\n") == {
        "sync", "compile_count", "current"}  # fmt: skip


def _optimizer_tables(source, names):
    """Lines of a module that write optimizer knowledge down again: a dict keyed by one of the table's names
    (``{"sgd": ...}``), or a ``momentum=<number>`` default."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if set(keys) & names:
                found.append((node.lineno, tuple(keys)))
        if isinstance(node, ast.keyword) and node.arg == "momentum" and isinstance(node.value, ast.Constant):
            found.append((node.value.lineno, ("momentum",)))
    return found


def test_one_optimizer_table():
    """The named optimizers (their classes, default keywords, state per parameter) are written once, in
    training/optimizers.py, and fit, memory_plan and trace_step read it (issue 64: three tables had drifted apart).
    The backend, below the table, may map the table's names to its own fused classes, and only those names."""
    from tpu_utility.training.optimizers import OPTIMIZERS

    names = set(OPTIMIZERS)
    table = os.path.join(PACKAGE, "training", "optimizers.py")
    copies, backend_keys = [], set()
    for path, unit, _ in _modules():
        if path == table:
            continue
        for line, keys in _optimizer_tables(open(path, encoding="utf-8").read(), names):
            if unit.split(".")[0] == "backend" and "momentum" not in keys:
                backend_keys.update(keys)
            else:
                copies.append(f"{os.path.relpath(path, ROOT)}:{line} {keys}")
    assert not copies, "read training/optimizers.py's OPTIMIZERS instead:\n" + "\n".join(copies)
    assert backend_keys <= names, f"the backend names optimizers the table lacks: {sorted(backend_keys - names)}"
    # the check can fail: today's three old tables are each seen
    old = ('OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": partial(torch.optim.SGD, lr=0.1, momentum=0.9)}\n'
           '_NAMED = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}\n_NAMED_MOMENTUM = {"sgd": 0.9}\n')
    assert sorted(line for line, _ in _optimizer_tables(old, names)) == [1, 1, 2, 3]


def _asks_compile_pays(source):
    return [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute) and n.attr == "compile_pays"]


def test_one_place_settles_compile_auto():
    """Whether ``compile="auto"`` compiles is asked of the backend in compiler.py alone (``Compile.settled``); find_lr
    asked it again for its sweep (issue 64). The backend, which answers, is the other place the name appears."""
    asking = [f"{os.path.relpath(path, ROOT)}:{line}" for path, unit, _ in _modules()
              if unit != "compiler" and unit.split(".")[0] != "backend"
              for line in _asks_compile_pays(open(path, encoding="utf-8").read())]  # fmt: skip
    assert not asking, "settle compile='auto' with Compile.settled(steps):\n" + "\n".join(asking)
    assert _asks_compile_pays("x = backend.current().compute.compile_pays(num_steps)\n") == [1]  # the check can fail


# The entries whose bodies the rest of the package kept growing (issue 64): each under SHORT lines of body, its
# work in the rooms it calls (the backends' platform checks, the checked arguments' value objects).
SHORT = 60
SHORT_BODIES = {"tpu_utility/environment.py": ["setup_tpu"], "tpu_utility/training/fit.py": ["plan_fit"]}


def _body_lengths(source, names):
    """{name: lines of its body} for the module-level functions ``names``, the docstring left out (counted by ast)."""
    lengths = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            lengths[node.name] = body[-1].end_lineno - body[0].lineno + 1
    return lengths


def test_the_entries_that_grew_keep_their_bodies_short():
    long = {}
    for path, names in SHORT_BODIES.items():
        lengths = _body_lengths(open(os.path.join(ROOT, path), encoding="utf-8").read(), names)
        assert set(lengths) == set(names), f"{path} no longer defines {sorted(set(names) - set(lengths))}"
        long.update({f"{path} {name}": n for name, n in lengths.items() if n >= SHORT})
    assert not long, f"bodies of {SHORT} lines or more (move the work into the rooms they call): {long}"
    too_long = 'def f():\n    """Doc."""\n' + "    x = 1\n" * SHORT
    assert _body_lengths(too_long, ["f"]) == {"f": SHORT}  # the check can fail


def test_one_cycle_fits_arguments_are_read_from_its_signature_once_and_typed_as_checked():
    """No second list of one_cycle_fit's names to keep in step with the signature (``**locals()`` hid every parameter
    from static tools), and the checked values ``plan_fit`` reads carry their types, not ``Any``."""
    import dataclasses

    from tpu_utility.training.fit import FitArguments

    source = open(os.path.join(PACKAGE, "training", "fit.py"), encoding="utf-8").read()
    calls = [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id in ("locals", "vars")]  # fmt: skip
    assert not calls, f"fit.py reads locals() on lines {calls}: pass each argument to its check"
    untyped = {f.name: f.type for f in dataclasses.fields(FitArguments) if "Any" in str(f.type) or f.type in ("", "object")}
    assert not untyped, f"FitArguments fields typed loosely: {untyped}"
    assert len(dataclasses.fields(FitArguments)) < 30  # checked values (the schedule, the stop rule), not the 38 names


def _definitions():
    """{name: [module:line, ...]} of every function, method and class the package defines."""
    found = {}
    for path, _, _ in _modules():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.setdefault(node.name, []).append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    return found


def test_the_compile_names_say_one_thing_each():
    """compile_model is the public function alone (the backend's member is ``compute.torch_compile``); the
    decision ``Compile.decide`` returns is a ``CompileDecision``, not a ``Compiling`` beside ``compiling`` values
    holding a ``Compile``; the live bar's notice is ``CompileProgress``, apart from the ``RecompileNotice`` callback."""
    defined = _definitions()
    assert defined["compile_model"] == [d for d in defined["compile_model"] if d.startswith("tpu_utility/compiler.py")]
    assert len(defined["compile_model"]) == 1, defined["compile_model"]
    assert not {"Compiling", "CompileNotice"} & set(defined), "renamed in issue 64: CompileDecision, CompileProgress"
    assert {"CompileDecision", "CompileProgress", "RecompileNotice", "torch_compile"} <= set(defined)
