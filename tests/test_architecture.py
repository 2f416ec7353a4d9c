"""The layout holds: imports point down the layers, every backend implements the
interface, and ``import lowbit`` stays light."""

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.kernels import BACKENDS, Backend, Plan, get_backend
from lowbit.scheme import QuantScheme

PACKAGE = Path(lowbit.__file__).parent

# cli -> evaluation -> models/runtime -> ... data flows one way: a module may import from a
# lower layer or from its own package, never from a higher layer or a peer package.
LAYERS = {
    "scheme": 0, "_validate": 0, "_folders": 0,
    "_C": 0,  # the C++ extension: only kernels/cpu loads it
    "qtensor": 1, "kernels": 1,
    "ops": 2,
    "nn": 3, "recipe": 3, "sparse": 3,
    "algorithms": 4, "passes": 4, "formats": 4,
    "models": 5, "runtime": 5,
    "evaluation": 6,
    "cli": 7, "__main__": 8,
}


def _imports(path: Path, package_root: Path):
    """(line, imported top-level lowbit package) of every import in ``path``, function-level
    imports included, relative imports resolved."""
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    here = parts if path.name == "__init__.py" else parts[:-1]
    root = package_root.name
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
                if node.module == root:
                    names = [f"{root}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            bits = name.split(".")
            if bits[0] == root and len(bits) > 1 and not bits[1].startswith("__"):  # not __version__
                yield node.lineno, bits[1]


def layer_violations(package_root: Path) -> list[str]:
    """Every import that points up the layers or across to a peer package."""
    bad = []
    for path in sorted(package_root.rglob("*.py")):
        rel = path.relative_to(package_root)
        if rel == Path("__init__.py"):
            continue  # the package's lazy export table names every layer
        own = rel.parts[0].removesuffix(".py")
        if own not in LAYERS:
            bad.append(f"{rel}: module {own!r} has no layer in LAYERS")
            continue
        for line, target in _imports(path, package_root):
            if target == own:
                continue
            if target not in LAYERS:
                bad.append(f"{rel}:{line} imports unknown module {target!r}")
            elif LAYERS[target] >= LAYERS[own]:
                bad.append(f"{rel}:{line} imports {target} (layer {LAYERS[target]}) from {own} (layer {LAYERS[own]})")
        if own == "formats":
            bad += [f"{rel}:{line} formats import algorithms" for line, t in _imports(path, package_root)
                    if t == "algorithms"]
    return bad


def test_imports_point_down_the_layers():
    assert layer_violations(PACKAGE) == []


def test_the_layer_check_catches_a_kernel_importing_from_ops(tmp_path):
    pkg = tmp_path / "lowbit"
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "ops").mkdir()
    (pkg / "kernels" / "__init__.py").write_text("from ..scheme import QuantScheme\n")
    (pkg / "kernels" / "fast.py").write_text("def f():\n    from ..ops import linear\n")
    (pkg / "ops" / "__init__.py").write_text("from ..kernels import fast\n")
    (pkg / "scheme.py").write_text("import torch\n")
    assert layer_violations(pkg) == ["kernels/fast.py:2 imports ops (layer 2) from kernels (layer 1)"]


def test_import_lowbit_scheme_loads_no_kernels():
    code = ("import sys, lowbit.scheme, lowbit; lowbit.__version__; "
            "print(sorted(m for m in sys.modules if m.startswith('lowbit')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["lowbit", "lowbit.scheme"]


# -- the backend interface ------------------------------------------------------------------
METHODS = [name for name, f in inspect.getmembers(Backend, inspect.isfunction) if not name.startswith("_")]


def _backends():
    out = []
    for name in BACKENDS:
        try:
            out.append(get_backend(name))
        except ImportError:  # triton not installed: nothing to check
            continue
    return out


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
def test_every_backend_implements_the_interface_with_its_signatures(backend):
    assert isinstance(backend, Backend)
    for name in METHODS:
        params = list(inspect.signature(getattr(type(backend), name)).parameters)
        assert params == list(inspect.signature(getattr(Backend, name)).parameters), name


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("weight, act", [("int4-asym-g32", None), ("int4-sym-g128", None), ("int8-sym", None),
                                         ("int2-asym-g64", None), ("int8-sym", "int8-sym-token"),
                                         ("int4-asym-g128", "int8-asym-token")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_plan_names_a_kernel_of_its_backend_and_says_why(backend, weight, act, dtype):
    w, a = QuantScheme.parse(weight), None if act is None else QuantScheme.parse(act)
    for m in (1, 2, 5, 64):
        plan = backend.plan(w, a, m, 4096, dtype)
        assert isinstance(plan, Plan) and plan.kernel in backend.kernels and plan.why
