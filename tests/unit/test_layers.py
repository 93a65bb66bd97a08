"""The package as a map (docs/ARCHITECTURE.md): the layers in order, read on the source.

A module may import from its own layer or any layer below it, never above; type-only imports
(under `if TYPE_CHECKING:`) and imports inside functions count the same. No import cycle at all.
Horovod and the frameworks stay in their rooms.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Top to bottom. A module belongs to the layer of its longest matching prefix.
LAYERS = [
    ("api", ["hvtrain", "hvtrain.__main__", "hvtrain.api"]),
    ("cli", ["hvtrain.cli"]),
    ("tools", ["hvtrain.tools"]),
    ("training", ["hvtrain.training"]),
    ("runtime", ["hvtrain.runtime"]),
    ("pipeline", ["hvtrain.pipeline"]),
    ("backend implementations", ["hvtrain.backends.torch", "hvtrain.backends.tensorflow"]),
    ("backend interface", ["hvtrain.backends.base", "hvtrain.backends.stage", "hvtrain.backends.steps"]),
    ("model", ["hvtrain.model"]),
    ("metrics", ["hvtrain.metrics"]),
    ("data", ["hvtrain.data"]),
    ("io", ["hvtrain.io"]),
    ("config and its leaves", ["hvtrain.config", "hvtrain.backends", "hvtrain.backends.registry",
                               "hvtrain.metrics.names"]),
    ("launch", ["hvtrain.launch"]),
    ("errors", ["hvtrain.errors", "hvtrain.version"]),
]


def module_files() -> dict[str, Path]:
    out = {}
    for folder, prefix in ((ROOT / "hvtrain", "hvtrain"), (ROOT / "backends", "hvtrain.backends")):
        for path in folder.rglob("*.py"):
            if "backends" in path.relative_to(folder).parts:  # a development symlink hvtrain/backends
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def layer_of(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[0]


def imported(module: str, source: str, known: set[str]) -> set[str]:
    """The hvtrain modules `source` (the text of `module`) imports, anywhere in it."""
    out = set()
    package = module if module in PACKAGES else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and name.startswith("hvtrain"):
                out.add(name)
    # `from hvtrain.x.y import z` also names its packages: only the deepest module counts
    return {m for m in out if not any(o.startswith(m + ".") for o in out)}


FILES = module_files()
PACKAGES = {m for m, p in FILES.items() if p.name == "__init__.py"}


def graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    known = set(FILES)
    texts = {m: p.read_text() for m, p in FILES.items()}
    texts.update(sources or {})
    return {m: imported(m, text, known) for m, text in texts.items()}


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                  for m, targets in edges.items() for t in targets if layer_of(t) < layer_of(m))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_layer_and_imports_only_its_own_or_lower_layers():
    assert upward(graph()) == []


def test_the_layer_check_fails_on_a_reversed_import():
    """The check itself: the schema importing the loop (a real upward edge, type-only) is caught,
    and so is the Reporter importing the runtime inside a function."""
    schema = FILES["hvtrain.config.schema"].read_text()
    reporter = FILES["hvtrain.io.reporter"].read_text()
    reversed_ = {"hvtrain.config.schema": schema + "\nif TYPE_CHECKING:\n    from hvtrain.training.loop import fit\n",
                 "hvtrain.io.reporter": reporter + "\ndef f():\n    from hvtrain.runtime import session\n"}
    assert upward(graph(reversed_)) == [
        "hvtrain.config.schema (config and its leaves) imports hvtrain.training.loop (training)",
        "hvtrain.io.reporter (io) imports hvtrain.runtime.session (runtime)"]


def test_no_import_cycle_type_only_imports_included():
    assert cycles(graph()) == []
    looped = {"hvtrain.data.readers": FILES["hvtrain.data.readers"].read_text()
              + "\nfrom hvtrain.data.dataset import Dataset\n"}  # dataset imports readers: a cycle, same layer
    found = cycles(graph(looped))
    assert len(found) == 1 and {"hvtrain.data.dataset", "hvtrain.data.readers"} <= set(found[0]), found


def test_the_top_level_holds_subpackages_and_five_modules():
    modules = sorted(p.name for p in (ROOT / "hvtrain").glob("*.py"))
    assert modules == ["__init__.py", "__main__.py", "api.py", "errors.py", "version.py"], modules


def test_package_init_files_import_nothing():
    """Importing one module never drags in a layer it does not need (a package __init__ importing its
    modules would run the whole layer, and create import cycles at run time)."""
    allowed = {"hvtrain": {"hvtrain.errors", "hvtrain.version", "hvtrain.api"},  # api: lazily, on first use
               "hvtrain.cli": None}  # the click group: its thin commands, lazily importing the library
    for module in sorted(PACKAGES):
        if allowed.get(module, set()) is None:
            continue
        got = graph()[module]
        assert got <= allowed.get(module, set()), (module, got)


def third_party(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_horovod_is_used_only_by_the_runtime_and_the_launcher():
    """`hvd` only inside the runtime: the backends ask the runtime's framework binding for the
    distributed optimizer, broadcasts, averages and elastic state."""
    users = sorted(m for m, p in FILES.items() if "horovod" in third_party(p))
    assert users == ["hvtrain.launch.horovodrun", "hvtrain.runtime.horovod", "hvtrain.runtime.tensorflow_horovod",
                     "hvtrain.runtime.torch_horovod"], users
    hvd = sorted(m for m, p in FILES.items() if not m.startswith("hvtrain.runtime")
                 for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.Attribute) and node.attr in ("hvd", "_hvd"))
    assert hvd == [], hvd


def test_frameworks_are_imported_only_by_their_backend_and_binding():
    frameworks = {"torch", "tensorflow", "keras", "tf2onnx", "onnx", "onnxruntime"}
    allowed = ("hvtrain.backends.torch", "hvtrain.backends.tensorflow", "hvtrain.runtime.torch_horovod",
               "hvtrain.runtime.tensorflow_horovod",
               "hvtrain.tools.export",  # onnx / onnxruntime read and verify an ONNX artefact of either framework
               "hvtrain.tools.doctor")  # asks torch and TensorFlow which GPUs and CUDA they see
    bad = sorted((m, sorted(third_party(p) & frameworks)) for m, p in FILES.items()
                 if third_party(p) & frameworks and not m.startswith(allowed))
    assert bad == [], bad


def test_the_python_api_names_are_not_shadowed_by_a_subpackage():
    """`hvtrain.train`, `.evaluate` and `.predict` are the Python API's functions: no subpackage
    may take one of those names (importing `hvtrain.<name>.x` would replace the function by the
    package in hvtrain's namespace)."""
    import subprocess
    import sys

    code = ("import hvtrain, hvtrain.training.loop, hvtrain.tools.predict, hvtrain.runtime.session\n"
            "assert all(callable(getattr(hvtrain, n)) for n in ('train', 'evaluate', 'predict')), "
            "[type(getattr(hvtrain, n)) for n in ('train', 'evaluate', 'predict')]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert not {"train", "evaluate", "predict"} & {p.name for p in (ROOT / "hvtrain").iterdir() if p.is_dir()}
