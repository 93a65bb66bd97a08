"""Conventions checked on the source: no private names across modules, mirrored backends (the
layer order itself: tests/unit/test_layers.py)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> list[tuple[str, list[str]]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
    return out


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_module_imports_a_private_name_of_another():
    bad = [(p.relative_to(ROOT), mod, name) for folder in ("hvtrain", "backends") for p in modules(folder)
           for mod, names in imports(p) for name in names
           if name.startswith("_") and not name.startswith("__") and mod.startswith(("hvtrain", "."))]
    assert not bad, bad


def test_both_backends_have_the_same_files_and_public_functions():
    files = {b: sorted(p.name for p in (ROOT / "backends" / b).glob("*.py")) for b in ("torch", "tensorflow")}
    assert files["torch"] == files["tensorflow"], files

    def public(path: Path) -> dict[str, list[str]]:
        """Public functions (and public classes' methods) with their parameter names."""
        out = {}
        for n in ast.parse(path.read_text()).body:
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"):
                out[n.name] = [a.arg for a in n.args.args + n.args.kwonlyargs]
            if isinstance(n, ast.ClassDef) and n.name.startswith(("Torch", "TensorFlow")):
                for m in n.body:
                    if isinstance(m, ast.FunctionDef) and (not m.name.startswith("_") or m.name == "__init__"):
                        out[f"<Backend class>.{m.name}"] = [a.arg for a in m.args.args + m.args.kwonlyargs]
        return out

    only_tf = {"is_rng"}  # Keras keeps RNG state in variables; torch's RNG is process-global
    for name in files["torch"]:
        a, b = public(ROOT / "backends/torch" / name), public(ROOT / "backends/tensorflow" / name)
        b = {k: v for k, v in b.items() if k not in only_tf}
        assert sorted(a) == sorted(b), (name, sorted(set(a) ^ set(b)))
        for fn in a:
            assert a[fn] == b[fn], (name, fn, a[fn], b[fn])
