"""The package's import rule, checked over every module's source (no imports executed).

    cluster (replicas on Ray Serve) -> entrypoints (server, CLI, offline LLM) -> async_engine
    -> engine
    engine -> {core: sched + kv + request (pure Python, no torch), worker: executor} -> model
    -> kernels

Each layer may import the layers below it, never one above; ``config``, ``sampling_params``,
``outputs``, ``kernels.isa`` and the package root (``__version__``) are shared leaves any
layer may import. ``bench`` and ``sim`` are research tools on top: nothing in the serving path
imports them, except the CLI, lazily (inside the function that runs the subcommand); the
server starts ``cluster`` the same way, for ``serve --replicas``.
``integrations`` (plug-ins loaded by other engines) imports only the shared leaves, and
nothing imports it, except the simulator, which imports the pure ``integrations.alignment``
(standard library only) to model the vLLM plug-in with the plug-in's own functions.
Imports under ``if TYPE_CHECKING:`` count: they are dependencies of the code as written.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "alignedserve"

SHARED = {"alignedserve", "alignedserve.config", "alignedserve.sampling_params",
          "alignedserve.outputs", "alignedserve.kernels.isa"}

# layer -> the layers it may import (besides itself and SHARED)
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "huge_pages": set(),
    "kv": set(),
    "request": {"kv"},
    "sched": {"kv", "request"},
    "model": {"kernels", "huge_pages"},
    "executor": {"model", "kernels", "huge_pages", "kv", "request", "sched"},
    "step_stats": {"kv", "sched"},
    "engine": {"executor", "model", "kernels", "kv", "request", "sched", "step_stats"},
    "async_engine": {"engine"},
    "entrypoints": {"async_engine", "engine", "step_stats", "cluster"},
    # scale-out: replicas (engines) behind the server's front end
    "cluster": {"entrypoints", "async_engine", "engine", "step_stats"},
    # research tools: may use the core and the model's config, and each other
    "bench": {"engine", "entrypoints", "model", "sched", "kv", "request", "step_stats", "sim"},
    "sim": {"bench", "engine", "model", "sched", "kv", "request", "step_stats", "cluster"},
    # plug-ins for other engines: loaded inside those engines, so they use nothing of ours
    # beyond the shared leaves and themselves (no torch, no engine of our own)
    "integrations": set(),
}
# (layer, target) pairs allowed only inside a function: the CLI starts the tools on demand.
LAZY_ONLY = {("entrypoints", "bench"), ("entrypoints", "sim"), ("entrypoints", "cluster")}


# (layer, module) pairs allowed across the rule: the simulator models the vLLM plug-in with the
# plug-in's pure functions (never integrations.vllm, which needs vLLM).
PLUGIN_MODELS = {("sim", "alignedserve.integrations.alignment")}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name inside the package (None: a shared leaf)."""
    if module in SHARED:
        return None
    parts = module.split(".")
    if parts[0] != "alignedserve" or len(parts) < 2:
        return None
    return parts[1]


def imports(source: str) -> list[tuple[str, bool]]:
    """(imported alignedserve module, imported at module level?) for each import in source."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import x`: x may be a submodule (its own layer) or just a name in pkg
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names
                                     if _is_module(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "alignedserve":
                found.append((name, _at_module_level(tree, node)))
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _at_module_level(tree: ast.Module, target: ast.AST) -> bool:
    """True unless ``target`` sits inside a function body."""
    def visit(node: ast.AST, in_function: bool) -> bool | None:
        if node is target:
            return not in_function
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            if (result := visit(child, inside)) is not None:
                return result
        return None
    return bool(visit(tree, False))


def violations(module: str, source: str) -> list[str]:
    """Imports in ``source`` (the text of ``module``) that break the rule."""
    layer = layer_of(module)
    bad = []
    for name, module_level in imports(source):
        if name in SHARED or any(name.startswith(s + ".") for s in SHARED - {"alignedserve"}):
            continue
        target = layer_of(name)
        if target is None or target == layer or layer is None or (layer, name) in PLUGIN_MODELS:
            continue
        if target in ALLOWED.get(layer, set()):
            continue
        if (layer, target) in LAZY_ONLY and not module_level:
            continue
        bad.append(f"{module} imports {name} ({layer} -> {target})")
    return sorted(set(bad))


def package_modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def test_every_module_follows_the_import_rule():
    bad = [v for module, path in package_modules() for v in violations(module, path.read_text())]
    assert not bad, "\n".join(bad)


def test_every_module_says_what_it_is_for():
    """A newcomer reads a file's first lines first: every module opens with a docstring."""
    sources = {m: path.read_text() for m, path in package_modules()}
    missing = [m for m, text in sources.items() if ast.get_docstring(ast.parse(text)) is None]
    assert not missing, missing


def test_nothing_in_the_serving_path_imports_the_plug_ins():
    users = [m for m, path in package_modules() if layer_of(m) != "integrations"
             and any(layer_of(name) == "integrations" and (layer_of(m), name) not in PLUGIN_MODELS
                     for name, _ in imports(path.read_text()))]
    assert not users, users


def test_every_layer_is_known():
    layers = {layer_of(m) for m, _ in package_modules()} - {None}
    assert layers <= set(ALLOWED), f"add to ALLOWED: {sorted(layers - set(ALLOWED))}"


@pytest.mark.parametrize("module,source", [
    # the model reaching up into the engine
    ("alignedserve.model.llama", "from alignedserve.engine import LLMEngine\n"),
    # the scheduler (core, no torch) importing the worker
    ("alignedserve.sched.aligned", "import alignedserve.executor.runner\n"),
    # kernels importing the model, even lazily
    ("alignedserve.kernels.dispatch",
     "def f():\n    from alignedserve.model.config import ModelConfig\n"),
    # the server importing the simulator at module level (lazily is allowed)
    ("alignedserve.entrypoints.server", "from alignedserve.sim import runner\n"),
    # the engine importing the server
    ("alignedserve.engine", "if True:\n    from alignedserve.entrypoints import server\n"),
    # the simulator importing the plug-in that needs vLLM, or the engine the pure one
    ("alignedserve.sim.runner", "from alignedserve.integrations.vllm import AlignedScheduler\n"),
    ("alignedserve.engine", "from alignedserve.integrations.alignment import length_groups\n"),
])
def test_an_upward_import_is_caught(module, source):
    assert violations(module, source)


def test_allowed_imports_pass():
    assert not violations("alignedserve.entrypoints.cli",
                          "def run():\n    from alignedserve.bench import cli\n")
    assert not violations("alignedserve.model.llama",
                          "from alignedserve.kernels import Kernels\n"
                          "from alignedserve.config import EngineConfig\n")
    assert not violations("alignedserve.sim.plugin_policy",
                          "from alignedserve.integrations.alignment import ordered_groups\n")
