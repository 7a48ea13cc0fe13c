"""The package's layers import one way (docs/architecture.md): a module may import from its own
subpackage and from those listed for it here, nothing above. An import added against the grain
fails here, naming the file and the line."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stree"
BELOW = {
    "stree.tree": set(),
    "stree.kernels": {"stree.tree"},
    "stree.sampling": {"stree.tree"},
    "stree.drafters": {"stree.tree", "stree.sampling"},
    "stree.models": {"stree.tree", "stree.kernels"},
    "stree.checkpoints": {"stree.tree", "stree.kernels", "stree.models"},
    "stree.runtime": {"stree.tree", "stree.kernels", "stree.models"},
    "stree.training": {"stree.tree", "stree.kernels", "stree.models", "stree.checkpoints"},
    "stree.testing": {"stree.tree", "stree.kernels", "stree.models", "stree.sampling", "stree.drafters"},
    "stree.decoding": {"stree", "stree.tree", "stree.kernels", "stree.models", "stree.checkpoints", "stree.runtime",
                       "stree.sampling", "stree.drafters"},
    "stree.patterns": {"stree.tree", "stree.models", "stree.sampling", "stree.drafters", "stree.decoding"},
    "stree.serving": {"stree", "stree.tree", "stree.models", "stree.sampling", "stree.drafters", "stree.decoding",
                      "stree.patterns"},
}
# the public names of loading kept on stree.models (resolved on first use, never at import)
ALLOWED = {("stree/models/__init__.py", "stree.checkpoints")}


def _layer(module: str) -> str:
    """The subpackage or root module ``module`` lives in ("stree" for a name of the root package)."""
    parts = module.split(".")
    if len(parts) > 1 and ((PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").exists()):
        return ".".join(parts[:2])
    return "stree"


def _imports(path: Path):
    rel = path.relative_to(PACKAGE.parent)
    module = ".".join(rel.with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # "from .. import kernels" imports the module stree.kernels, not the package root
            targets = [f"{target}.{a.name}" for a in node.names] if node.module is None else [target]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == "stree" or t.startswith("stree."):
                yield str(rel), node.lineno, module, t


def test_every_layer_imports_only_the_layers_below_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for rel, line, module, target in _imports(path):
            layer, dep = _layer(module), _layer(target)
            if layer not in BELOW or dep == layer or (rel, dep) in ALLOWED:
                continue
            if dep not in BELOW[layer]:
                wrong.append(f"{rel}:{line} ({layer}) imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_package_root_holds_only_the_public_api():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py", "lm.py", "tree.py"]


def test_no_timings_in_comments_or_docstrings():
    """Figures go stale where code cannot check them: timings live in benchmarks/results and the
    docs, never in the package's comments or docstrings (a count of ms, us, seconds or tok/s,
    or an "Nx faster")."""
    import io
    import re
    import tokenize

    figure = re.compile(r"\b\d+(?:\.\d+)?\s*(?:ms|us|µs|ns|seconds?|sec|s|tok/s)\b|\b\d+(?:\.\d+)?x\s+(?:faster|slower)")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = path.read_text()
        texts = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
                 if t.type == tokenize.COMMENT]
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    texts.append((getattr(node, "lineno", 1), doc))
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {m.group(0)!r}" for line, text in texts
                  for m in figure.finditer(text)]
    assert not found, "\n".join(found)
