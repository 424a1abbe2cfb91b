"""The package's shape: frameworks behind the backend seam, private names in one place, sizes.

Read from the source (AST), so that a module that starts importing
TensorFlow, or reading a private Keras name, outside its place fails here.
"""

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfaccum"
FRAMEWORKS = ("tensorflow", "tf_keras", "jax", "torch")


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


GENERATED = ("accumulation_pb2.py",)  # protoc's output, not ours
# Where a backend's Keras 2 is read: its names are tf_keras', read apart from Keras 3's.
TF_KERAS_ADAPTERS = ("backend/tensorflow/_keras_on_tf/tf_keras.py",
                     "backend/tensorflow/_keras_on_tf/batch_norm.py")
INTERNAL_MODULES = ("keras.src", "tf_keras.src", "tensorflow.python")
PYTHON_NAMES = {"_replace", "_fields", "_asdict", "_make"}  # a namedtuple's API


def is_adapter(path):
    """The core's `_keras` or a backend's `_keras_on_*`: where Keras' private names are read."""
    return any(part.removesuffix(".py") == "_keras" or part.startswith("_keras_on_")
               for part in path.relative_to(PACKAGE).parts)


def is_private(name):
    return name.startswith("_") and not name.startswith("__")


@pytest.fixture(scope="module")
def keras_private_names():
    """Every private name Keras 3 and tf_keras define or read, from their sources."""
    import importlib.util

    names = set()
    for library in ("keras", "tf_keras"):
        spec = importlib.util.find_spec(library)
        if spec is None:
            continue
        for path in (pathlib.Path(spec.origin).parent / "src").rglob("*.py"):
            try:
                tree = ast.parse(path.read_text())
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and is_private(node.attr):
                    names.add(node.attr)
                elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and is_private(node.name):
                    names.add(node.name)
    assert "_compute_loss" in names and "_jax_state" in names  # the scan reads Keras
    return names


def own_private_names():
    """Private names tfaccum gives its own objects (set on `self`, defined in a class)."""
    own = set()
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    own |= {e.attr for e in ast.walk(target) if isinstance(e, ast.Attribute)
                            and isinstance(e.value, ast.Name) and e.value.id == "self"
                            and is_private(e.attr)}
            elif isinstance(node, ast.ClassDef) and not is_adapter(path):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        own |= {item.name} if is_private(item.name) else set()
                    elif isinstance(item, ast.Assign):
                        own |= {t.id for t in item.targets
                                if isinstance(t, ast.Name) and is_private(t.id)}
    return own


def keras_internals_read(path, keras_names, own):
    """What `path` reads of Keras' internals: private attributes (also by `getattr`
    with a string), imports of and strings naming `keras.src` and the like."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in keras_names - own - PYTHON_NAMES:
            found.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and is_private(node.args[1].value)
              and node.args[1].value not in own):
            found.add(node.args[1].value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                         else [alias.name for alias in node.names]):
                if name.startswith(INTERNAL_MODULES):
                    found.add(name)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value.startswith(INTERNAL_MODULES)):
            found.add(node.value.split(":")[0])
    return found


@pytest.fixture(scope="module")
def adapters_read(keras_private_names):
    """{adapter module: what it reads of Keras' internals}, and the same outside them."""
    own = own_private_names()
    read = {relative(p): keras_internals_read(p, keras_private_names, own)
            for p in modules() if relative(p) not in GENERATED}
    inside = {path: names for path, names in read.items()
              if is_adapter(PACKAGE / path) and names}
    outside = {path: names for path, names in read.items()
               if not is_adapter(PACKAGE / path) and names}
    return inside, outside


def test_keras_internals_are_read_only_in_the_adapters(adapters_read):
    # The core's `_keras` (what every backend reads of Keras), a backend's
    # `_keras_on_tf` / `_keras_on_jax` / `_keras_on_torch` (what that
    # framework's Keras is read for). tfaccum's own private names are told
    # apart (set on `self`, defined in its classes).
    _, outside = adapters_read
    assert not outside, (
        "Keras internals read outside the adapters (move each into tfaccum/_keras/ or the "
        f"backend's _keras_on_* package): {outside}")


def test_a_private_name_read_outside_an_adapter_fails_the_scan(tmp_path, keras_private_names):
    module = tmp_path / "leaky.py"
    module.write_text("from keras.src import ops\n\n"
                      "def f(model):\n    return model._compute_loss, getattr(model, '_jax_state')\n")
    assert keras_internals_read(module, keras_private_names, own_private_names()) == {
        "keras.src", "_compute_loss", "_jax_state"}


def test_each_private_name_is_read_in_one_adapter(adapters_read):
    inside, _ = adapters_read
    readers = {}
    for path, names in inside.items():
        library = "tf_keras" if path in TF_KERAS_ADAPTERS else "keras"
        for name in names:
            readers.setdefault((library, name), []).append(path)
    twice = {name: paths for name, paths in readers.items() if len(paths) > 1}
    assert not twice, f"read in more than one adapter (keep each in one): {twice}"


def documented_private_names():
    """{adapter: names} from docs/how-it-works.md's list of what each adapter reads."""
    text = (PACKAGE.parent / "docs" / "how-it-works.md").read_text()
    block = text.split("<!-- private-names -->")[1].split("<!-- /private-names -->")[0]
    listed = {}
    for line in block.splitlines():
        if line.startswith("- `tfaccum/"):
            path, _, names = line[len("- `tfaccum/"):].partition("`")
            listed[path] = set(re.findall(r"`([^`]+)`", names.split(":", 1)[1]))
    return listed


def test_how_it_works_lists_the_private_names_each_adapter_reads(adapters_read):
    inside, _ = adapters_read
    assert documented_private_names() == inside, (
        "docs/how-it-works.md's list of private names differs from what the adapters read")


def test_adapters_say_the_versions_they_were_read_in(adapters_read):
    inside, _ = adapters_read
    for path in inside:
        assert re.search(r"3\.\d+-3\.16|2\.16-2\.21",
                         (PACKAGE / path).read_text()), path


def test_the_newest_keras_tested_is_the_makefiles_pin():
    from tfaccum._keras import private

    makefile = (PACKAGE.parent / "Makefile").read_text()
    assert f"NEXT_KERAS := {private.NEWEST_TESTED}\n" in makefile


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
