"""The import graph drawn from the code's own imports (module level and inside functions alike): no circles, the
kernels on the ground floor (``qerl_kernels`` imports nothing from ``qerl``), the library below the benchmarks and
the CLI (nothing outside ``qerl.bench`` / ``qerl.cli`` imports them), the rollout below the trainer."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in (("qerl", "qerl"), ("qerl_kernels", "qerl_kernels")):
        for f in (ROOT / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = f
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:  # the module a dotted import lands in (a name inside it, or the module)
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            edges[m] |= {t for t in map(owner, names) if t and t != m}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v), on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_circles_and_no_arrows_back_up():
    edges = _graph()
    assert len(edges) > 80 and sum(map(len, edges.values())) > 200  # the walk found the code
    assert _cycles(edges) == []
    up = [(a, b) for a, bs in edges.items() for b in bs if a.startswith("qerl_kernels") and b.startswith("qerl.")]
    assert up == [], "qerl_kernels must import nothing from qerl"
    for top, above in (("qerl.bench", ("qerl.bench", "qerl.cli")), ("qerl.cli", ("qerl.cli", "qerl.__main__"))):
        users = sorted({a for a, bs in edges.items() for b in bs if b.startswith(top) and not a.startswith(above)})
        assert users == [], f"{top} is imported by {users}"
    below_train = [(a, b) for a, bs in edges.items() for b in bs
                   if a.startswith(("qerl.rollout", "qerl.ops", "qerl.quant", "qerl.models", "qerl.rl"))
                   and b.startswith(("qerl.train", "qerl.stages"))]
    assert below_train == []
    low = ("qerl.inputs", "qerl.workflow_config", "qerl.methods", "qerl.readers", "qerl.owned", "qerl.outputs",
           "qerl.argtypes", "qerl.yamlio", "qerl.data")  # read by the Snakefile and every stage: nothing above
    up_from_low = [(a, b) for a, bs in edges.items() for b in bs if a.startswith(low)
                   and b.startswith(("qerl.stages", "qerl.train", "qerl.bench", "qerl.cli", "qerl.rollout"))]
    assert up_from_low == []


def test_the_walk_sees_imports_inside_functions(tmp_path):
    """The check is not blind to the imports that hid the old circles (inside functions)."""
    src = "def f():\n    from qerl.train.plan import keep_engine_cache\n"
    names = [f"{n.module}.{a.name}" for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)
             for a in n.names]
    assert names == ["qerl.train.plan.keep_engine_cache"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
