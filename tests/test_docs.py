"""The front door: the README, the documentation site and what they promise.

The site is built once (offline, `--strict`); the API reference must name
every public name and the hook's public methods; the refusals page must hold
exactly the messages the code raises; the README stays short, its versions
table agrees with pyproject.toml and the Makefile's oldest pair, and its
links land; the quickstart and each guide's first code block run as written.
"""

import ast
import html
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import tfaccum

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
GAP = "…"  # what a refusal's text fills in at run time

# The pages, the site and each guide's first block (run under the backend its
# page names) are the same whatever backend the pass runs: read once, in the
# TensorFlow pass (one suite run per backend, no copies: CI's time).
pytestmark = [pytest.mark.once, pytest.mark.backend(
    "tensorflow", reason="the docs read and run alike in every pass: the TensorFlow pass's")]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built as `make docs` builds it, into a directory of its own."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def html_ids(page):
    return set(re.findall(r'id="([^"]+)"', page.read_text()))


# -- the API reference ------------------------------------------------------


def public_methods(path, class_name):
    """The public methods and properties `class_name` in `path` defines (read, not imported)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {item.name for item in node.body
                    if isinstance(item, ast.FunctionDef) and not item.name.startswith("_")}
    raise AssertionError(f"{path} defines no class {class_name}")


def test_every_public_name_and_hook_method_is_in_the_built_reference(site):
    ids = html_ids(site / "api" / "index.html")
    documented = {anchor.rsplit(".", 1)[-1] for anchor in ids if anchor.startswith("tfaccum.")}
    # Every backend's `AccumulationHook` is documented once, as their front.
    documented |= {"AccumulationHook"} if "tfaccum.hook_front.HookFront" in ids else set()
    missing = sorted(set(tfaccum.__all__) - documented)
    assert not missing, f"not in docs/api.md's rendered reference: {missing}"
    # The callback's and the backends' business, and the backup's hooks into the hook.
    internal = {"made_with", "watched_by", "uninstall", "observer_state", "set_observer_state",
                "backup_refusal"}
    for path in [ROOT / "tfaccum" / "hook_front.py", *(
            ROOT / "tfaccum" / "backend" / backend / "hook.py"
            for backend in ("tensorflow", "jax", "torch"))]:
        own = public_methods(path, "HookFront" if path.name == "hook_front.py"
                             else "AccumulationHook")
        missing = sorted(name for name in own - internal
                         if f"tfaccum.hook_front.HookFront.{name}" not in ids)
        assert not missing, f"{path}: methods not in the reference: {missing}"
    text = (site / "api" / "index.html").read_text()
    for counter in tfaccum.counts.Counters.__dataclass_fields__:
        assert f"{counter}" in text, counter


def test_the_reference_shows_types_and_no_internal_parameter(site):
    """Each argument's type is in the signatures; what only tfaccum passes is not."""
    page = re.sub(r"<[^>]+>", "", (site / "api" / "index.html").read_text())
    page = html.unescape(re.sub(r"\s+", " ", page))
    for shown in ("accumulation_steps: int | dict[int, int] | Callable[[int], int]",
                  "skip_nonfinite: bool | None = None",
                  "backup_dir: str | PathLike",
                  "-> AccumulationHook | None"):
        assert shown in page, shown
    hook = page.split("AccumulationHook ¶")[1].split("accumulation_steps ¶")[0]
    assert "accumulation_steps int" in hook and "observers" not in hook


# -- every refusal, on one page -----------------------------------------------

# Raised, but no refusal of the user's input: Python's protocol for a module
# attribute, and a programming error inside the counts' store.
NOT_REFUSALS = {"module 'tfaccum' has no attribute …", "Unknown counts: …"}


def _template(node, names):
    """A message expression's literal text: `names` for the parameters a
    caller gave as literals, GAP for everything filled in at run time."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_template(value, names) for value in node.values)
    if isinstance(node, ast.FormattedValue):
        value = node.value
        if (isinstance(value, ast.Name) and value.id in names and node.conversion == -1
                and node.format_spec is None):
            return names[value.id]
        return GAP
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _template(node.left, names) + _template(node.right, names)
    return GAP


def _is_text(node):
    return ((isinstance(node, ast.Constant) and isinstance(node.value, str))
            or isinstance(node, ast.JoinedStr)
            or (isinstance(node, ast.BinOp) and (_is_text(node.left) or _is_text(node.right))))


def normal(text):
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(f"{GAP}(\\s*{GAP})+", GAP, text)


def raised_messages(source):
    """The message of every `raise E("...")` in `source`, as a user reads it.

    A helper that raises with its parameters (`refuse(what, why, fix)`) is read
    at each call in the same module, its literal arguments put in place.
    """
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def enclosing_function(node):
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    messages = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                and node.exc.args and _is_text(node.exc.args[0])):
            continue
        message, function = node.exc.args[0], enclosing_function(node)
        parameters = []
        if function is not None:
            arguments = function.args
            reassigned = {target.id for inner in ast.walk(function)
                          if isinstance(inner, (ast.Assign, ast.AugAssign))
                          for target in (inner.targets if isinstance(inner, ast.Assign)
                                         else [inner.target])
                          if isinstance(target, ast.Name)}
            parameters = [a.arg for a in arguments.posonlyargs + arguments.args
                          + arguments.kwonlyargs if a.arg not in reassigned]
        used = {n.id for n in ast.walk(message) if isinstance(n, ast.Name)} & set(parameters)
        calls = [call for call in ast.walk(tree) if used and isinstance(call, ast.Call)
                 and isinstance(call.func, ast.Name) and call.func.id == function.name]
        if not calls:
            messages.append(normal(_template(message, {})))
            continue
        positional = [a.arg for a in function.args.posonlyargs + function.args.args]
        for call in calls:
            given = {name: _template(arg, {}) for name, arg in zip(positional, call.args)}
            given.update({k.arg: _template(k.value, {}) for k in call.keywords if k.arg})
            messages.append(normal(_template(message, {p: given.get(p, GAP)
                                                       for p in parameters})))
    return messages


def code_refusals():
    found = set()
    for path in sorted((ROOT / "tfaccum").rglob("*.py")):
        found.update(raised_messages(path.read_text()))
    return found - NOT_REFUSALS


def page_refusals():
    text = (DOCS / "refusals.md").read_text()
    return {normal(block) for block in re.findall(r"^```text\n(.*?)^```", text, re.M | re.S)}


def test_the_refusals_page_holds_every_refusal_the_code_raises_and_no_other():
    code, page = code_refusals(), page_refusals()
    assert len(code) > 80  # the reader still finds them
    missing = sorted(code - page)
    stale = sorted(page - code)
    assert not missing, ("raised in tfaccum/ but not on docs/refusals.md (add each in a "
                         "```text block, … for what is filled in):\n" + "\n".join(missing))
    assert not stale, "on docs/refusals.md but raised nowhere:\n" + "\n".join(stale)


def test_the_refusal_reader_reads_helpers_and_what_they_are_given():
    source = textwrap.dedent('''
        def check(x):
            def refuse(what, fix):
                raise ValueError(f"cannot {what} yet. {fix} Received: {x!r}")
            if x:
                refuse(f"serve {x}", "Use y.")
            raise TypeError("`x` must be " + f"an int. Received: x={x}")
    ''')
    assert sorted(raised_messages(source)) == [
        "`x` must be an int. Received: x=…", "cannot serve … yet. Use y. Received: …"]


# -- the README ---------------------------------------------------------------


def readme_table(heading):
    """The rows of the first table under `## heading`, as lists of cells."""
    section = README.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    return rows[0], [row for row in rows[2:]]


def test_the_readme_is_a_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"
    text = README.read_text()
    assert "<!-- benchmark:" not in text, "tables belong in benchmarks/RESULTS.md"
    assert "make demo" in text and "make test" in text


def test_the_readme_versions_agree_with_pyproject_and_the_oldest_pair():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {"Python": project["requires-python"]}
    for requirement in project["dependencies"]:
        name, bound = re.match(r"([\w.-]+)(.*)", requirement).groups()
        wanted[name] = bound
    seen = set(wanted)
    for extra in ("tensorflow", "tf-keras", "jax", "torch"):  # each package under the first extra naming it
        for requirement in extras[extra]:
            name, bound = re.match(r"([\w.-]+)(.*)", requirement).groups()
            if name not in seen:
                seen.add(name)
                wanted[f"{name} (extra `{extra}`)"] = bound
    oldest = dict(pin.split("==") for pin in re.search(
        r"^OLDEST := (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split())

    header, rows = readme_table("Supported versions")
    assert header[:3] == ["package", "supported", "oldest tested (`make test-oldest`)"]
    table = {row[0]: row for row in rows}
    spelled = {key.lower().replace(" ", "").replace("_", "-"): key for key in table}
    for name, bound in wanted.items():
        key = spelled.get(name.lower().replace(" ", "").replace("_", "-"))
        assert key is not None, f"README's versions table has no row for {name}"
        assert table[key][1].replace(" ", "") == bound.replace(" ", ""), (name, table[key][1])
        package = name.split(" ")[0].lower().replace("-", "_")
        pins = {pin.lower().replace("-", "_"): version for pin, version in oldest.items()}
        if package in pins:
            assert table[key][2] == pins[package], (name, table[key][2], pins[package])
            if package in ("tensorflow", "keras", "tf_keras"):  # the oldest pair itself
                assert bound.strip() == f">={pins[package]}", (
                    f"pyproject.toml's lower bound for {name} is not what make test-oldest pins")


def readme_links():
    return re.findall(r"\]\(([^)\s]+)\)", README.read_text())


def nav_guides():
    """The pages of mkdocs.yml's Guides section, in order."""
    nav = (ROOT / "mkdocs.yml").read_text().split("  - Guides:\n", 1)[1].split("\n  - ", 1)[0]
    return re.findall(r":\s*([\w-]+\.md)\s*$", nav, re.M)


def test_the_readme_links_land_and_reach_every_guide(site):
    links = readme_links()
    for link in links:
        if re.match(r"\w+://", link):
            continue
        path, _, anchor = link.partition("#")
        assert (ROOT / path).exists(), f"README links to {link}, which does not exist"
        if anchor and path.startswith("docs/") and path.endswith(".md"):
            page = site / Path(path).relative_to("docs").with_suffix("") / "index.html"
            assert anchor in html_ids(page), f"README links to {link}: no such heading"
    linked = {link.partition("#")[0] for link in links}
    assert not [g for g in nav_guides() if f"docs/{g}" not in linked], "a guide the README misses"


def test_no_code_line_is_cut_at_the_sites_right_edge():
    # The site's content column shows 80 characters of code at 1280 px.
    long = [f"{path.name}: {line}" for path in [README, *sorted(DOCS.glob("*.md"))]
            for block in re.findall(r"^```\w*\n(.*?)^```", path.read_text(), re.M | re.S)
            for line in block.splitlines() if len(line) > 80]
    assert not long, "code lines over 80 characters:\n" + "\n".join(long)


def test_no_commit_hashes_in_the_readme_or_the_guides():
    hash_like = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
    for path in [README, *(DOCS / guide for guide in nav_guides()), DOCS / "index.md"]:
        found = hash_like.findall(path.read_text())
        assert not found, f"{path.name} names commits: {found}"


# -- the code a reader copies -------------------------------------------------


def first_python_block(path):
    blocks = re.findall(r"^```python\n(.*?)^```", path.read_text(), re.M | re.S)
    assert blocks, f"{path.name} has no python block"
    return blocks[0]


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def run_block(code, cwd, **env):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT), **env)
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md",
                                  *(f"docs/{guide}" for guide in nav_guides())])
def test_the_quickstart_and_each_guides_main_block_run(page, tmp_path):
    # (The strategies guide's MirroredStrategy() has one replica here: a CPU.)
    code = first_python_block(ROOT / page)
    if page == "docs/several-machines.md":
        # The script as each machine runs it: two workers here, told by TF_CONFIG.
        workers = [f"127.0.0.1:{port}" for port in free_ports(2)]
        processes = [run_block(code, tmp_path, KERAS_BACKEND="tensorflow", TF_CONFIG=json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}))
            for index in range(2)]
    else:
        backend = {"docs/jax.md": "jax", "docs/torch.md": "torch"}.get(page, "tensorflow")
        processes = [run_block(code, tmp_path, KERAS_BACKEND=backend)]
    for process in processes:
        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0, f"{page}'s first python block:\n{out[-3000:]}"


# -- results in their place ---------------------------------------------------


def test_every_benchmark_table_has_its_place_and_its_line_in_results():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run_all
    finally:
        sys.path.pop(0)
    results = run_all.RESULTS.read_text()
    blocks = {m["name"]: m["body"] for m in run_all.MARKER.finditer(results)}
    assert sorted(blocks) == sorted([*run_all.TABLES, *run_all.GPU_TABLES])
    for name, body in blocks.items():
        if body.strip() != "Not measured yet.":
            assert re.match(r"_Measured on .+, \d{4}-\d{2}-\d{2}, .+, commit \w+", body), name
    assert run_all.HEADER.search(results)
    written = run_all.write_results(results, {"memory": "| a |\n|---|"}, "Measured on here.",
                                    ["memory"])
    after = {m["name"]: m["body"] for m in run_all.MARKER.finditer(written)}
    assert after["memory"] == "_Measured on here._\n\n| a |\n|---|\n"
    assert after["step-ops"] == blocks["step-ops"]  # a table not rerun keeps its own line
    assert "Last run: memory. Measured on here." in written
