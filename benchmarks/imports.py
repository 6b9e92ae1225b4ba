"""
What a reader has to import, counted: `python benchmarks/imports.py [--json FILE]`.

For each entry point (`from llm import LLM`, `import scheduler`, serve.py's default path) it runs a fresh
interpreter, imports that entry, and counts the project modules (files under this repository) that
ended up in sys.modules, with their lines. Then it reads every project file's import statements (module
level and inside functions alike, since a local import is still a dependency; not those under
`if TYPE_CHECKING:`, which never run) and reports the import
graph's cycles (strongly connected components of more than one module) and its floors: the number of
modules on the longest chain of imports, cycles collapsed to one floor. No project module is imported
by this script itself, so it runs in any venv that holds the files.
"""
import argparse
import ast
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES = {
    "from llm import LLM": "from llm import LLM",
    "import scheduler": "import scheduler",
    # serve.py's default path: the app, its launcher and the one engine core it starts by default
    "serve.py (default)": "import serve, engine_core",
}
PROBE = """
import json, os, sys
root = sys.argv[1]
sys.path.insert(0, root)
exec(sys.argv[2])
mods = {}
for name, m in list(sys.modules.items()):
    f = getattr(m, "__file__", None) or ""
    if f.startswith(root + os.sep) and f.endswith(".py") and os.sep + "." not in f[len(root):]:
        mods[name] = sum(1 for _ in open(f))
print(json.dumps(mods))
"""


def imported_by(statement: str) -> dict[str, int]:
    """{module: lines} of the project modules a fresh interpreter holds after `statement`."""
    out = subprocess.run([sys.executable, "-c", PROBE, ROOT, statement], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def project_modules() -> dict[str, str]:
    """{dotted module name: path} for every project .py file (not the tests, not hidden folders)."""
    mods = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__")) and d not in ("csrc", "results", "docs")]
        for f in filenames:
            if f.endswith(".py") and f != "test_all.py":
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return mods


def import_graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file)."""
    graph = {}
    for name, path in mods.items():
        deps = set()
        package = name.rpartition(".")[0] if not path.endswith("__init__.py") else name
        tree = ast.parse(open(path).read())
        typing_only = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If) and "TYPE_CHECKING" in ast.dump(t.test)
                       for b in t.body for n in ast.walk(b)}       # annotations' imports: never run
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:                             # relative: from . import x
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def floors(graph: dict[str, set[str]], comps: list[list[str]], start: str | None = None) -> tuple[int, list[str]]:
    """The longest import chain (from `start`, or from anywhere), in modules, each cycle one floor."""
    rep = {m: c[0] for c in comps for m in c}
    dag: dict[str, set[str]] = {}
    for v, ws in graph.items():
        dag.setdefault(rep.get(v, v), set()).update(rep.get(w, w) for w in ws if rep.get(w, w) != rep.get(v, v))
    memo: dict[str, list[str]] = {}

    def chain(v):
        if v not in memo:
            memo[v] = [v] + max((chain(w) for w in dag.get(v, ())), key=len, default=[])
        return memo[v]

    best = chain(rep.get(start, start)) if start else max((chain(v) for v in dag), key=len)
    return len(best), best


def main():
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    report = {}
    for label, statement in ENTRIES.items():
        mods = imported_by(statement)
        report[label] = {"modules": len(mods), "lines": sum(mods.values()), "names": sorted(mods)}
        print(f"{label:24s} {len(mods):3d} project modules, {sum(mods.values()):6d} lines: {' '.join(sorted(mods))}")
    graph = import_graph(project_modules())
    comps = cycles(graph)
    n, chain = floors(graph, comps)
    report["cycles"], report["floors"], report["longest_chain"] = comps, n, chain
    print(f"import graph: {len(graph)} modules, {n} floors: {' -> '.join(chain)}")
    n, chain = floors(graph, comps, "serve")
    report["serve_floors"], report["serve_chain"] = n, chain
    print(f"from serve.py: {n} floors: {' -> '.join(chain)}")
    print(f"cycles: {len(comps)} {comps}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
