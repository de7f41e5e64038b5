"""The package's shape (`issues` 21's must-show): no import circle, module- or function-level;
the distributed optimizers and checkpoints use the optimizers' public contract only."""

from __future__ import annotations

import ast
from pathlib import Path

import orthoptim

ROOT = Path(orthoptim.__file__).parent


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its text (a package's `__init__` it
    lives in is left out: importing a submodule runs it, it is not a dependency)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return {t for t in found if not (known[t].name == "__init__.py" and name.startswith(t + "."))}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (module → the modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return [*path[path.index(d) :], d]
            if d not in state and (circle := visit(d, [*path, d])):
                return circle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (circle := visit(m, [m])):
            return circle
    return None


def test_no_import_circle():
    known = modules()
    circle = find_circle({m: imports(m, p, known) for m, p in known.items()})
    assert circle is None, "import circle: " + " → ".join(circle or [])


def test_a_circle_would_be_found(tmp_path):
    """The check above can fail: two modules importing each other, one of them inside a
    function, are reported."""
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg import a\n")
    known = {"pkg.a": tmp_path / "a.py", "pkg.b": tmp_path / "b.py"}
    graph = {m: imports(m, p, known) for m, p in known.items()}
    assert find_circle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


# torch's own private attributes of a tensor, which have no public spelling: the version
# counter that in-place writes bump (the layer-wise optimizer's check that the gradients were
# not changed between backward and step)
TENSOR_PRIVATE = {"_version"}


def private_reaches(path: Path) -> list[str]:
    """`x._name` in `path` where x is not self/cls/super() (a class's own and inherited
    hooks), torch, or an object of a class defined in this very file (its own private
    attributes)."""
    tree = ast.parse(path.read_text())
    own = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    # the methods of the classes defined here (a table naming `Class._method`)
    own |= {
        item.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.FunctionDef)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        base = ast.unparse(node.value)
        if node.attr.startswith("__") or base in ("self", "cls", "super()") or node.attr in own:
            continue
        if base.split(".")[0] in ("torch", "Tensor") or node.attr in TENSOR_PRIVATE:
            continue
        found.append(f"{path.name}:{node.lineno}: {base}.{node.attr}")
    return found


def test_distributed_code_and_checkpoints_use_the_public_contract_only():
    files = [*sorted((ROOT / "parallel").glob("*.py")), ROOT / "checkpoint.py"]
    assert [r for f in files for r in private_reaches(f)] == []


def test_a_private_reach_would_be_found(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g(opt):\n    return opt.inner._update()\n")
    assert private_reaches(f) == ["m.py:2: opt.inner._update"]


# Private names of the standard library that have no public spelling: the type of
# `add_subparsers()`'s result, and the caller's frame (the dry run's record of where a
# collective was issued).
STDLIB_PRIVATE = {"argparse._SubParsersAction", "sys._getframe"}
# The one module that reaches into torch's private API, each reach commented there.
COMPAT = ROOT / "_torch_compat.py"
# Hooks of torch's protocols that are private by name only: a torch optimizer's
# `_init_group`, which dynamo recognises by that name and runs eagerly in a traced step.
TORCH_PROTOCOL = {"_init_group"}


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines itself: attributes it sets or reads on self/cls or
    assigns on anything, its functions and classes, its assignments and arguments."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and (
            isinstance(node.ctx, ast.Store)
            or (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    return own


def cross_module_private_reads(path: Path) -> list[str]:
    """`x._name` or `from m import _name` (or from a private module of another package) in
    `path`, where `_name` is not one this module defines: another module's private attribute,
    torch's included. Dunders and the standard library's `STDLIB_PRIVATE` are not private."""
    tree = ast.parse(path.read_text())
    own = _own_private_names(tree)
    where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            foreign = not node.module.startswith("orthoptim")
            private_module = foreign and any(
                p.startswith("_") and not p.startswith("__") for p in node.module.split(".")
            )
            names = [a.name for a in node.names if a.name.startswith("_")]
            if private_module or [n for n in names if not n.startswith("__")]:
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
            continue
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        base = ast.unparse(node.value)
        if node.attr.startswith("__") or f"{base}.{node.attr}" in STDLIB_PRIVATE:
            continue
        if base in ("self", "cls", "super()") or node.attr in own | TORCH_PROTOCOL:
            continue
        found.append(f"{where}:{node.lineno}: {base}.{node.attr}")
    return found


def test_no_module_reads_another_modules_private_attributes():
    """Outside the torch compatibility module, no source module reads a private attribute
    of another module (or of torch): what crosses a module boundary is public."""
    reads = [r for f in sorted(ROOT.rglob("*.py")) if f != COMPAT
             for r in cross_module_private_reads(f)]  # fmt: skip
    assert reads == [], "\n".join(reads)


def test_a_cross_module_private_read_would_be_found(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "from orthoptim.checkpoint import _fsync_dir\nimport torch\n"
        "class A:\n    def __init__(self):\n        self._mine = 1\n"
        "def g(opt, a):\n    a._mine\n    torch._C\n    return opt._buckets\n"
    )
    assert cross_module_private_reads(f) == [
        "m.py:1: from orthoptim.checkpoint import ...",
        "m.py:8: torch._C",
        "m.py:9: opt._buckets",
    ]


def test_no_test_module_imports_another():
    """Shared test models and helpers live in tests/models/ (and tests/distributed.py,
    tests/reference_runs.py): importing a test module would run its module-level setup and
    tie its edits to its importers."""
    tests = Path(__file__).parent
    names = {f.stem for f in tests.rglob("test_*.py")}
    found = []
    for f in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module.split(".")[-1]]
            elif isinstance(node, ast.Import):
                mods = [a.name.split(".")[-1] for a in node.names]
            found += [f"{f.name}:{node.lineno}: {m}" for m in mods if m in names - {f.stem}]
    assert found == [], found


MAX_FILE_LINES, MAX_CLASS_LINES, LONG_FUNCTION = 900, 500, 80
MAX_LONG_FUNCTIONS = 6  # argparse builders (add_parser, add_*_arguments) aside


def test_the_rooms_stay_small():
    """No source file over 900 lines, no class over 500, at most 6 functions over 80 lines
    besides the argparse builders: a room that outgrows this is doing two jobs."""
    big_files, big_classes, long = [], [], []
    for f in sorted(ROOT.rglob("*.py")):
        text = f.read_text()
        where = f.relative_to(ROOT).as_posix()
        if len(text.splitlines()) > MAX_FILE_LINES:
            big_files.append(where)
        for node in ast.walk(ast.parse(text)):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                big_classes.append(f"{where}:{node.name}")
            builder = node.__class__ is ast.FunctionDef and node.name.startswith("add_")
            if isinstance(node, ast.FunctionDef) and size > LONG_FUNCTION and not builder:
                long.append(f"{where}:{node.name} ({size} lines)")
    assert big_files == [] and big_classes == [], (big_files, big_classes)
    assert len(long) <= MAX_LONG_FUNCTIONS, long


def borrowed_from_collectives(path: Path, helpers: set[str]) -> list[str]:
    """`C.name` or `from orthoptim.collectives import name` in `path`, where C is
    `orthoptim.collectives` and `name` one of `helpers` (a shard helper or byte formula,
    whose home is `orthoptim.shards` / `orthoptim.comm_bytes`)."""
    tree = ast.parse(path.read_text())
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "orthoptim":
            aliases |= {a.asname or a.name for a in node.names if a.name == "collectives"}
        elif isinstance(node, ast.ImportFrom) and node.module == "orthoptim.collectives":
            found += [f"{path.name}:{node.lineno}: {a.name}" for a in node.names
                      if a.name in helpers]  # fmt: skip
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "orthoptim.collectives"}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr in helpers
        ):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_shard_helpers_and_byte_formulas_are_imported_from_their_modules():
    """`orthoptim.collectives` is the collectives: the shard helpers and the byte formulas are
    imported from `orthoptim.shards` and `orthoptim.comm_bytes`, not through it (by the source
    and the tests)."""
    from orthoptim import comm_bytes, shards

    helpers = {
        n
        for m in (shards, comm_bytes)
        for n, obj in vars(m).items()
        if getattr(obj, "__module__", None) == m.__name__ and not n.startswith("_")
    }
    files = [*ROOT.rglob("*.py"), *Path(__file__).parent.rglob("*.py")]
    assert [r for f in sorted(files) for r in borrowed_from_collectives(f, helpers)] == []
