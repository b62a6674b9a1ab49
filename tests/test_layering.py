"""Architecture rules: vLLM is touched only by mars/engine; the policy layer and the agent
integration stay importable without vLLM; one top-level import name is installed."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "mars"


def _imported_roots(path: pathlib.Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add((node.module or "").split(".")[0])
    return roots


def _files(sub: str = ""):
    return sorted((PKG / sub).rglob("*.py"))


def test_vllm_is_imported_only_in_the_engine_package():
    offenders = [str(p.relative_to(ROOT)) for p in _files()
                 if "vllm" in _imported_roots(p) and p.relative_to(PKG).parts[0] != "engine"]
    assert offenders == []


@pytest.mark.parametrize("sub,banned", [
    ("policy", {"vllm", "fastapi", "starlette", "uvicorn", "openhands", "torch", "zmq"}),
    ("openhands_integration", {"vllm", "torch", "fastapi"}),
    ("workloads", {"vllm", "torch", "openhands"}),
    # the simulator's own pieces: its only vLLM contact is mars/engine/harness/sim_engine.py
    ("sim", {"vllm", "torch", "fastapi", "starlette", "uvicorn", "openhands", "zmq"}),
])
def test_layer_is_framework_free(sub, banned):
    bad = {str(p.relative_to(ROOT)): _imported_roots(p) & banned for p in _files(sub)}
    assert {k: v for k, v in bad.items() if v} == {}


def test_single_top_level_package():
    """pyproject packages only ``mars*``; check nothing else would be picked up either."""
    import tomllib

    import setuptools

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    found = setuptools.find_packages(str(ROOT), include=include)
    assert found and {p.split(".")[0] for p in found} == {"mars"}
    from importlib.metadata import distribution

    assert distribution("mars-serve").read_text("top_level.txt").split() in (["mars"], None)


#: modules that drive policy objects: they call the declared contract
#: (:mod:`mars.policy.engine.base`, :class:`mars.policy.control.admission.BalanceAndAdmit`), never probe it
_POLICY_DRIVERS = ("engine/sched/scheduler.py", "engine/sched/coordinator.py",
                   "engine/sched/coscheduler.py", "engine/sched/calls.py",
                   "engine/sched/pins.py", "engine/harness/offline.py",
                   "sidecar/control.py", "policy/control/admission_core.py")


@pytest.mark.parametrize("rel", _POLICY_DRIVERS)
def test_adapters_never_probe_policy_objects(rel):
    """No ``getattr`` / ``hasattr`` in the adapters: an optional policy method is a declared
    no-op on the abstract base, so a typo is an error and not a silently skipped feature."""
    path = PKG / rel
    if not path.exists():
        pytest.skip(f"{rel} not present")
    probes = [f"{rel}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "hasattr")]
    assert probes == []


def test_policies_implement_the_declared_contracts():
    from mars.policy.engine.base import OrderingPolicy, RetentionPolicy
    from mars.policy.registry import POLICY_NAMES, get_policy

    for name in POLICY_NAMES:
        ordering, retention = get_policy(name).build()
        assert isinstance(ordering, OrderingPolicy), name
        assert isinstance(retention, RetentionPolicy), name


#: the one module of mars/emulate that may import torch: the harness that times a model's
#: operators on a GPU (it imports torch only when timing starts; tests/test_op_fit.py checks
#: that importing it loads no torch)
_TORCH_HARNESS = PKG / "emulate" / "op_timing.py"


def test_emulation_models_are_framework_free():
    bad = {str(p.relative_to(ROOT)): _imported_roots(p) & (
        {"vllm", "fastapi", "zmq"} | ({"torch"} if p != _TORCH_HARNESS else set()))
        for p in _files("emulate")}
    assert {k: v for k, v in bad.items() if v} == {}
    assert "torch" in _imported_roots(_TORCH_HARNESS)  # the exception names a real module


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _mars_imports(path: pathlib.Path) -> set[str]:
    """Every ``mars`` module ``path`` imports, lazy imports inside functions included."""
    mod = _module_name(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "mars"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "mars":
                out.add(target)
                out |= {f"{target}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in _files()}
    return {m: {t for t in _mars_imports(p) if t in files and t != m} for m, p in files.items()}


#: process entry points outside mars/cli/ that only hand their arguments to a command (none
#: now: ``mars-vllm serve`` starts its sidecar as ``python -m mars.cli.sidecar``)
COMMANDS_ELSEWHERE: set[str] = set()


def _is_command(m: str) -> bool:
    return m == "mars.cli" or m.startswith("mars.cli.") or m in COMMANDS_ELSEWHERE


def test_no_module_imports_a_command():
    """Commands sit on top (``mars/cli/``): nothing below a command imports one."""
    got = {m: sorted(t for t in ts if _is_command(t))
           for m, ts in _graph().items() if not _is_command(m)}
    assert {m: ts for m, ts in got.items() if ts} == {}


def test_the_two_planes_never_import_each_other():
    """The paper's two planes are two folders (§4.2 control, §4.3 engine): neither imports the
    other, and the schema both speak (``mars.protocol``) imports neither."""
    graph = _graph()

    def into(src: str, dst: str) -> dict[str, list[str]]:
        return {m: sorted(t for t in ts if t.startswith(dst)) for m, ts in graph.items()
                if m.startswith(src) and any(t.startswith(dst) for t in ts)}

    assert into("mars.policy.engine", "mars.policy.control") == {}
    assert into("mars.policy.control", "mars.policy.engine") == {}
    assert into("mars.protocol", "mars.policy") == {}
    assert "mars.policy.engine.base" in graph and "mars.policy.control.admission" in graph


def test_no_import_circle_between_modules():
    """No two modules import each other, directly or around a loop (lazy imports count:
    a loop hidden in a function is still a loop a reader has to untangle)."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []
