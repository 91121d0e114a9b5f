"""The library's layers, read from its source. Python: it never imports its harness
(retro.conformance, retro.fault_injection), and no two of its modules import each other, directly or
round a circle (every import that runs counts, at module level or inside a function; an import for
the type checker alone, under `if TYPE_CHECKING:`, never runs and names a type only). Native: the
core knows no Python, and the bindings only translate (no call of theirs changes a context)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

LIBRARY = REPO / "retro"
HARNESS = ("retro.conformance", "retro.fault_injection")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module the file imports, absolute (a name imported from a package counts as the
    submodule when it is one)."""
    name = _module_name(path)
    package = name if path.name in ("__init__.py", "__init__.pyi") else name.rsplit(".", 1)[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)  # an import by name is an import
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for p in LIBRARY.rglob("*.py*") if p.suffix in (".py", ".pyi") and "__pycache__" not in p.parts]
    modules = {_module_name(p) for p in files}
    graph: dict[str, set[str]] = {}
    for p in files:
        # a stub (.pyi) speaks for its module: its imports are the module's for the type checker
        graph.setdefault(_module_name(p), set()).update(m for m in _imports(p) if m in modules or m.startswith(HARNESS))
    for name, deps in graph.items():
        deps.discard(name)
    return graph


def test_the_library_never_imports_its_harness():
    graph = _graph()
    assert {"retro", "retro._gate", "retro.training", "retro.errors"} <= set(graph), sorted(graph)
    offenders = {m: sorted(d for d in deps if d.startswith(HARNESS)) for m, deps in graph.items()}
    assert not any(offenders.values()), {m: d for m, d in offenders.items() if d}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            # a package imported by its own submodules is loaded first by Python itself: not a circle
            if node.startswith(dep + "."):
                continue
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_in_the_library():
    graph = {m: {d for d in deps if not d.startswith(HARNESS)} for m, deps in _graph().items()}
    # the package's own __init__ gathers the public names from every module: it is the root, not a member
    graph = {m: {d for d in deps if d != "retro"} for m, deps in graph.items()}
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


NATIVE = REPO / "native"
# llama.cpp calls that change a context, and the guard every such call takes: the core's alone
CONTEXT_POLICY = re.compile(
    r"\b(llama_decode|llama_init_from_model|llama_free|llama_memory_clear|llama_memory_seq_rm|"
    r"llama_state_seq_get_data|llama_opt_(?:init|epoch|prepare\w*|step\w*)|retro_defect_on|CallGuard\s+\w+\s*\()"
)


def _code(path: Path) -> str:
    """The file without its comments."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(encoding="utf-8"), flags=re.S)


def test_the_native_core_knows_no_python():
    core = sorted((NATIVE / "core").glob("*.[ch]*"))
    assert len(core) > 10
    offenders = [p.name for p in core if re.search(r"#include\s*[<\"](pybind11/|Python\.h)", _code(p))]
    assert not offenders


def test_the_bindings_change_no_context_themselves():
    bindings = sorted((NATIVE / "bindings").glob("*.cpp"))
    assert {p.name for p in bindings} >= {"bind_context.cpp", "bind_trainer.cpp", "bind_transactions.cpp"}
    found = {p.name: sorted(set(CONTEXT_POLICY.findall(_code(p)))) for p in bindings}
    # the test door reads the switches for Python; the one switch on a binding's own path is about a
    # Python object (a handler's exception kept alive)
    allowed = {"bind_hooks.cpp": ["retro_defect_on"], "bind_transactions.cpp": ["retro_defect_on"]}
    assert {name: calls for name, calls in found.items() if calls and calls != allowed.get(name)} == {}


def test_the_policy_pattern_sees_a_context_call():
    assert CONTEXT_POLICY.findall("rc = llama_decode(c.ctx, batch); CallGuard call(c);") == [
        "llama_decode",
        "CallGuard call(",
    ]
