"""The package's shape: frameworks behind the backend seam, private names in one place, sizes.

Read from the source (AST), so that a module that starts importing
TensorFlow, or reading a private Keras name, outside its place fails here.
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfaccum"
FRAMEWORKS = ("tensorflow", "tf_keras", "jax", "torch")
PRIVATE = ("keras.src", "tensorflow.python", "tf_keras.src", "_keras_mask", "_tracker")


def modules():
    return sorted(PACKAGE.rglob("*.py"))


def relative(path):
    return path.relative_to(PACKAGE).as_posix()


def in_backend(path):
    return relative(path).startswith("backend/") and relative(path) != "backend/__init__.py"


def imports(path):
    """`(module name, at module level)` for every import in `path`."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, id(node) in top))
    return found


@pytest.mark.parametrize("path", [p for p in modules() if not in_backend(p)], ids=relative)
def test_outside_the_backends_no_framework_is_imported(path):
    for name, at_top in imports(path):
        assert name.split(".")[0] not in FRAMEWORKS, (
            f"{relative(path)} imports {name}: a framework belongs in tfaccum/backend/")
        # A backend is reached when a model asks for it, never when tfaccum is imported.
        if name.startswith("tfaccum.backend."):
            assert not at_top, f"{relative(path)} imports {name} at module level"


@pytest.mark.parametrize("path", modules(), ids=relative)
def test_private_names_are_read_only_in_a_keras_package(path):
    # The core's `_keras` (what every backend reads of Keras), a backend's
    # `_keras_on_tf` / `_keras_on_jax` (what that framework's Keras is read for).
    if any(part.removesuffix(".py") == "_keras" or part.startswith("_keras_on_")
           for part in path.relative_to(PACKAGE).parts):
        return
    source = path.read_text()
    for name in PRIVATE:
        assert name not in source, f"{relative(path)} reads {name} outside a _keras package"


def class_lengths(path):
    tree = ast.parse(path.read_text())
    return {node.name: node.end_lineno - node.lineno + 1
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


@pytest.mark.parametrize("path", modules(), ids=relative)
def test_sizes_a_reader_can_hold(path):
    assert len(path.read_text().splitlines()) <= 500, relative(path)
    for name, length in class_lengths(path).items():
        limit = 250 if name == "AccumulationHook" else 300
        assert length <= limit, f"{relative(path)}: class {name} has {length} lines"


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_importing_tfaccum_on_jax_or_torch_loads_no_tensorflow(backend):
    pytest.importorskip(backend)
    core = [relative(p)[:-3].replace("/", ".").removesuffix(".__init__")
            for p in modules() if not in_backend(p)]
    script = (
        "import importlib, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(('tfaccum.' + name).rstrip('.').replace('tfaccum.__init__', 'tfaccum'))\n"
        "import tfaccum\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'tf_keras')))\n"
    )
    env = dict(os.environ, KERAS_BACKEND=backend)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def module_name(path):
    parts = ["tfaccum", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circle():
    """Module-level imports between tfaccum's modules form no cycle (an import
    inside a function, made when first used, is how a backend is reached)."""
    names = {module_name(p): p for p in modules()}
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(names)
                # `from package import submodule` needs the submodule, not the package's body.
                found |= submodules if len(submodules) == len(node.names) else {node.module}
        graph[name] = found & set(names) - {name}
    done, path = set(), []

    def visit(name):
        assert name not in path, "import circle: " + " -> ".join(path[path.index(name):] + [name])
        if name not in done:
            path.append(name)
            for dependency in sorted(graph[name]):
                visit(dependency)
            path.pop()
            done.add(name)

    for name in sorted(graph):
        visit(name)


def test_no_module_name_stands_in_the_core_and_in_a_backend():
    """Each concept once: a backend's module is named for what only it does."""
    core = {p.relative_to(PACKAGE).parts[0].removesuffix(".py")
            for p in modules() if not relative(p).startswith("backend/")}
    for backend in (PACKAGE / "backend").iterdir():
        if backend.is_dir() and not backend.name.startswith("__"):
            names = {p.relative_to(backend).parts[0].removesuffix(".py")
                     for p in backend.rglob("*.py")} - {"__init__"}
            assert not names & core, f"backend/{backend.name} repeats core names {sorted(names & core)}"
