"""Each package imports with its own extra alone, and the packages depend on each other one way.

Rules:
- A package's *closure* is what `pip install` would bring for its extra: the core `dependencies`,
  the extra, the project extras it names (`basin[sim]`), then every distribution's own requirements
  (markers evaluated here; a third-party extra only where asked for, as in `uvicorn[standard]`).
- *Forbidden* for a package: every distribution in the closure of all the project's extras that is
  not in the package's closure. Only their top-level import names are blocked (a name that some
  allowed or unrelated distribution also provides passes); the stdlib and everything else pass.
- Every module of the package is imported in a fresh interpreter whose `sys.meta_path` finders cannot
  see the blocked names (`import` raises ModuleNotFoundError, `importlib.util.find_spec` answers None,
  as in a venv without them); a finder in front records who asked. A module fails if its import
  raises, or if one of our own modules asked for a blocked name at all (even inside `try`).
- `__main__` modules are imported only where that has no side effect (all code under the guard).
- Statically (`ast`, function-level imports included): each component imports only the components
  below it, and no module-level imports form a cycle among our modules.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import pkgutil
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PROJECT_NAME = canonicalize_name(PROJECT["name"])
OWN_PACKAGES = ("basin_runtime", "basin_sim", "basin_emulate", "basin_loadgen", "basin_stack", "basin_pipeline")
TRAINING_STACK = ("sklearn", "pandas", "optuna", "mlflow", "skl2onnx", "dvc", "scipy")
HTTP_STACK = ("starlette", "uvicorn", "httpx", "aiohttp", "openai")


@dataclass(frozen=True)
class Case:
    """A package and what a user installs to run it (`basin` alone is the core dependencies)."""

    package: str
    installs: tuple[str, ...]
    skip: tuple[str, ...] = ()
    # (distribution, import name): a name the distribution ships inside itself and puts on sys.path when
    # imported, so it imports in a venv of this extra alone though no distribution of it is installed
    vendored: tuple[tuple[str, str], ...] = ()


CASES = (
    Case("basin_runtime.policy", ()),  # the standard library only; see also runtime/test_policy_purity.py
    Case("basin_runtime", ("basin", "onnxruntime"), skip=("basin_runtime.gateway", "basin_runtime.state")),
    Case("basin_runtime.gateway", ("basin[serve]",)),
    # the gateway's shared admission state (`--state redis://...`): the Redis client comes with the serve extra
    Case("basin_runtime.state", ("basin[serve]",)),
    Case("basin_sim", ("basin[sim]",), skip=("basin_sim.experiments.ray_executor",)),
    # `--executor ray`: the one module that imports Ray, loaded only when that executor is chosen
    Case("basin_sim.experiments.ray_executor", ("basin[ray]",), vendored=(("ray", "psutil"), ("ray", "colorama"))),
    Case("basin_emulate", ("basin[emulate]",)),
    Case("basin_loadgen", ("basin[loadgen]",)),
    Case("basin_stack", ("basin[stack]",)),
    Case("basin_pipeline", ("basin[train]",)),
)


# --- closures --------------------------------------------------------------------------------------


def project_requirements(extras: Iterable[str]) -> list[Requirement]:
    """The core dependencies plus the named extras, as pyproject.toml lists them."""
    optional = PROJECT["optional-dependencies"]
    unknown = sorted(set(extras) - set(optional))
    assert not unknown, f"pyproject.toml [project.optional-dependencies] has no extra {unknown}"
    lines = [*PROJECT["dependencies"], *(line for extra in extras for line in optional[extra])]
    return [Requirement(line) for line in lines]


def requirements_of(distribution: str, extras: frozenset[str]) -> list[Requirement]:
    """An installed distribution's requirements that apply here with `extras` requested."""
    try:
        lines = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []  # not installed here, so nothing of it can be imported either
    wanted = []
    for line in lines:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": extra}) for extra in ("", *sorted(extras))):
            wanted.append(requirement)
    return wanted


def closure(installs: Iterable[str]) -> set[str]:
    """Every third-party distribution (canonical name) that installing `installs` brings."""
    pending = [Requirement(line) for line in installs]
    seen: set[tuple[str, frozenset[str]]] = set()
    distributions: set[str] = set()
    while pending:
        requirement = pending.pop()
        name, extras = canonicalize_name(requirement.name), frozenset(requirement.extras)
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name == PROJECT_NAME:
            pending.extend(project_requirements(extras))
        else:
            distributions.add(name)
            pending.extend(requirements_of(name, extras))
    return distributions


EVERYTHING = closure([f"basin[{','.join(PROJECT['optional-dependencies'])}]"])


def import_names() -> dict[str, set[str]]:
    """Each top-level import name and the distributions (canonical names) that provide it."""
    providers: dict[str, set[str]] = {}
    for name, distributions in importlib.metadata.packages_distributions().items():
        providers.setdefault(name, set()).update(canonicalize_name(d) for d in distributions)
    return providers


PROVIDERS = import_names()


def blocked_names(case: Case) -> dict[str, str]:
    """The import names `case` may not use, each with a distribution that provides it."""
    forbidden = EVERYTHING - closure(case.installs)
    vendored = {name for _, name in case.vendored}
    return {
        name: sorted(distributions)[0]
        for name, distributions in PROVIDERS.items()
        if distributions <= forbidden and name not in sys.stdlib_module_names and name not in OWN_PACKAGES
        and name not in vendored
    }


@pytest.mark.parametrize(("distribution", "name"), [pair for case in CASES for pair in case.vendored])
def test_a_vendored_name_is_shipped_inside_its_distribution(distribution: str, name: str) -> None:
    files = importlib.metadata.files(distribution) or []
    assert any(f.parts[-2:] == (name, "__init__.py") and "thirdparty_files" in f.parts for f in files), (
        f"{distribution} no longer ships {name} in its thirdparty_files: drop it from `vendored`"
    )


# --- modules ---------------------------------------------------------------------------------------


def submodules(package: str) -> dict[str, Path]:
    """`package` and every module below it (a plain module: itself), each with its source file, found without
    importing them."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin, f"{package} is not found"
    assert Path(spec.origin).is_relative_to(ROOT), f"{package} is imported from {spec.origin}, not from {ROOT}"
    found = {package: Path(spec.origin)}
    if not spec.submodule_search_locations:
        return found
    pending = [(Path(location), package + ".") for location in spec.submodule_search_locations]
    while pending:
        directory, prefix = pending.pop()
        for info in pkgutil.iter_modules([str(directory)], prefix):
            short = info.name.rpartition(".")[2]
            if info.ispkg:
                found[info.name] = directory / short / "__init__.py"
                pending.append((directory / short, info.name + "."))
            else:
                found[info.name] = directory / f"{short}.py"
    return dict(sorted(found.items()))


def is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":`."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    return (
        isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def runs_code_on_import(path: Path) -> bool:
    """Whether importing the file does more than define things (imports, defs, plain constants)."""
    definitions = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, definitions) or is_main_guard(node):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign | ast.AnnAssign) and not any(
            isinstance(n, ast.Call) for n in ast.walk(node)
        ):
            continue
        return True
    return False


def importable_modules(case: Case) -> list[str]:
    """The modules of `case` that this test imports."""
    return [
        module
        for module, path in submodules(case.package).items()
        if not any(module == s or module.startswith(s + ".") for s in case.skip)
        and not (module.endswith(".__main__") and runs_code_on_import(path))
    ]


# --- the fresh interpreter -------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import importlib, json, sys, traceback

    payload = json.loads(sys.argv[1])
    BLOCKED, OWN, refusals = payload["blocked"], tuple(payload["own"]), []
    INTERNAL = ("importlib", "importlib.util", "__main__")

    def importers(frame):
        # The innermost non-importlib frame (the direct importer) and the innermost one of ours.
        direct = ours = None
        while frame is not None and ours is None:
            name = frame.f_globals.get("__name__", "?")
            internal = frame.f_code.co_filename.startswith("<frozen importlib") or name in INTERNAL
            if not internal:
                where = {"module": name, "file": frame.f_code.co_filename, "line": frame.f_lineno}
                direct = direct or where
                ours = where if name.partition(".")[0] in OWN else None
            frame = frame.f_back
        return direct, ours

    class RecordBlocked:
        # First on sys.meta_path: notes the attempt; the finders behind it are told to find nothing.
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            top = fullname.partition(".")[0]
            if top in BLOCKED:
                direct, ours = importers(sys._getframe(1))
                refusals.append({"name": fullname, "distribution": BLOCKED[top], "direct": direct, "ours": ours})
            return None

    class Blind:
        # A finder that cannot see the blocked names: `import` raises ModuleNotFoundError and
        # `importlib.util.find_spec` answers None, as in a venv without them.
        def __init__(self, finder):
            self.finder = finder

        def __getattr__(self, name):
            return getattr(self.finder, name)

        def find_spec(self, fullname, path=None, target=None):
            if fullname.partition(".")[0] in BLOCKED:
                return None
            return self.finder.find_spec(fullname, path, target)

    # Start-up hooks that .pth files import (setuptools' `_distutils_hack`) are not imports of ours.
    preloaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED and not m.startswith("_"))
    sys.meta_path[:] = [RecordBlocked, *(Blind(f) for f in sys.meta_path)]
    results = []
    for module in payload["modules"]:
        first = len(refusals)
        try:
            importlib.import_module(module)
            error = None
        except BaseException as exc:  # SystemExit too: a module must not exit on import
            error = traceback.format_exception_only(exc)[-1].strip()
        results.append({"module": module, "error": error, "refusals": refusals[first:]})
    print(json.dumps({"preloaded": preloaded, "results": results}))
    """
)


def run_child(
    modules: list[str], blocked: dict[str, str], cwd: Path = ROOT, own: tuple[str, ...] = OWN_PACKAGES
) -> dict[str, Any]:
    """Import `modules` in a fresh interpreter that refuses `blocked`; the child's report."""
    payload = json.dumps({"modules": modules, "blocked": blocked, "own": own})
    result = subprocess.run([sys.executable, "-c", CHILD, payload], capture_output=True, text=True, cwd=cwd,
                            timeout=120)
    assert result.returncode == 0, f"the import check itself crashed:\n{result.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def where(frame: dict[str, Any] | None) -> str:
    if frame is None:
        return "?"
    path = Path(frame["file"])
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"{frame['module']} ({shown}:{frame['line']})"


def problems(label: str, report: dict[str, Any]) -> list[str]:
    """One line per violation in a child's report, naming package, module and forbidden import."""
    found = [f"{label}: {m} was already imported at start-up (a .pth file?)" for m in report["preloaded"]]
    seen: dict[str, list[str]] = {}  # one line per blocked import site, with the modules it breaks
    for result in report["results"]:
        module, error = result["module"], result["error"]
        explained = False
        for refusal in result["refusals"]:
            ours, direct = refusal["ours"], refusal["direct"]
            is_fatal = error is not None and f"No module named {refusal['name']!r}" in error
            explained = explained or is_fatal
            if not is_fatal and (ours is None or ours != direct):
                continue  # a third-party module probed an optional import and coped: so would a venv
            via = "" if ours == direct else f" via {where(direct)}"
            site = (f"imports {refusal['name']!r} (distribution {refusal['distribution']}, not in this extra) "
                    f"at {where(ours)}{via}")
            seen.setdefault(site, []).append(module)
        if error is not None and not explained:
            found.append(f"{label}: importing {module} failed: {error}")
    for site, modules in seen.items():
        first = next((m for m in modules if f" at {m} (" in site), modules[0])  # the module with the import
        more = f" (and {len(modules) - 1} more modules)" if len(modules) > 1 else ""
        found.append(f"{label}: importing {first}{more} {site}")
    return found


@pytest.fixture(scope="module")
def reports() -> Iterator[dict[str, Future[dict[str, Any]]]]:
    """Every case's child report, the interpreters all started at once."""
    with ThreadPoolExecutor(max_workers=len(CASES)) as pool:
        yield {case.package: pool.submit(run_child, importable_modules(case), blocked_names(case))
               for case in CASES}


def label_of(case: Case) -> str:
    return f"{case.package} [{' '.join(case.installs) or 'stdlib only'}]"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.package)
def test_every_module_imports_with_its_own_extra_alone(
    case: Case, reports: dict[str, Future[dict[str, Any]]]
) -> None:
    report = reports[case.package].result()
    imported = [r["module"] for r in report["results"]]
    assert case.package in imported and len(imported) == len(importable_modules(case))
    assert len(imported) > 1 or submodules(case.package)[case.package].name != "__init__.py"  # a package's walk
    found = problems(label_of(case), report)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("package", "names"),
    [
        ("basin_runtime.policy", ("numpy", "onnxruntime", "starlette")),
        ("basin_runtime", (*TRAINING_STACK, *HTTP_STACK, "matplotlib", "tqdm")),
        ("basin_runtime.gateway", (*TRAINING_STACK, "openai", "matplotlib", "aiohttp")),  # one upstream client
        ("basin_sim", (*TRAINING_STACK, *HTTP_STACK, "ray")),
        ("basin_sim.experiments.ray_executor", TRAINING_STACK + HTTP_STACK),
        ("basin_emulate", (*TRAINING_STACK, "openai", "httpx", "smg")),
        ("basin_loadgen", (*TRAINING_STACK, "starlette", "uvicorn", "smg")),
        ("basin_pipeline", ("httpx", "openai", "smg", "pytest")),  # mlflow and dvc bring starlette, uvicorn, aiohttp
    ],
)
def test_the_blocked_names_cover_what_the_house_style_forbids(package: str, names: tuple[str, ...]) -> None:
    case = next(c for c in CASES if c.package == package)
    blocked = blocked_names(case)
    assert sorted(set(names) - set(blocked)) == []
    for allowed in {"basin_runtime": ("numpy", "onnxruntime", "yaml"), "basin_sim": ("matplotlib", "tqdm"),
                    "basin_sim.experiments.ray_executor": ("ray", "tqdm")}.get(package, ()):
        assert allowed not in blocked


def test_the_check_names_the_module_and_the_blocked_import(tmp_path: Path) -> None:
    package = tmp_path / "standin"  # a stand-in for one of our packages; `shim` for a third-party one
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "timeline.py").write_text('"""Doc."""\n\nimport json\nimport starlette\n')
    (package / "lazy.py").write_text("try:\n    import httpx\nexcept ImportError:\n    httpx = None\n")
    (package / "wrapped.py").write_text("try:\n    import httpx\nexcept ImportError:\n    raise RuntimeError('no')\n")
    (package / "via.py").write_text("import shim\n")
    (tmp_path / "shim.py").write_text("import importlib.util\nimportlib.util.find_spec('httpx')\nimport starlette\n")
    blocked = {"starlette": "starlette", "httpx": "httpx"}
    modules = ["standin.timeline", "standin.lazy", "standin.wrapped", "standin.via", "json"]
    found = problems("standin [sim]", run_child(modules, blocked, cwd=tmp_path, own=("standin",)))
    at = f"(distribution starlette, not in this extra) at standin.timeline ({package / 'timeline.py'}:4)"
    assert found == [
        "standin [sim]: importing standin.wrapped failed: RuntimeError: no",
        f"standin [sim]: importing standin.timeline imports 'starlette' {at}",
        "standin [sim]: importing standin.lazy imports 'httpx' (distribution httpx, not in this extra) at "
        f"standin.lazy ({package / 'lazy.py'}:2)",  # caught, but still asked for by our own code
        "standin [sim]: importing standin.wrapped imports 'httpx' (distribution httpx, not in this extra) at "
        f"standin.wrapped ({package / 'wrapped.py'}:2)",
        "standin [sim]: importing standin.via imports 'starlette' (distribution starlette, not in this extra) at "
        f"standin.via ({package / 'via.py'}:1) via shim ({tmp_path / 'shim.py'}:3)",  # not the find_spec probe
    ]
    assert problems("standin", run_child(modules[:2], {}, cwd=tmp_path, own=("standin",))) == []


def test_a_main_module_that_runs_on_import_is_not_imported(tmp_path: Path) -> None:
    guarded, unguarded = tmp_path / "guarded.py", tmp_path / "unguarded.py"
    guarded.write_text('"""Doc."""\nfrom x import main\n\nif __name__ == "__main__":\n    raise SystemExit(main())\n')
    unguarded.write_text('"""Doc."""\nimport sys\nfrom x import main\n\nsys.exit(main())\n')
    assert not runs_code_on_import(guarded)
    assert runs_code_on_import(unguarded)


# --- static: direction and cycles ------------------------------------------------------------------

# component -> the components it may import, its own included. Only basin_stack uses the gateway.
RUNTIME = {"basin_runtime.policy", "basin_runtime"}
SIM = {"basin_sim", "basin_sim.experiments"}
MAY_IMPORT = {
    "basin_runtime.policy": {"basin_runtime.policy"},
    "basin_runtime": RUNTIME,
    "basin_runtime.gateway": RUNTIME | {"basin_runtime.gateway"},
    "basin_sim": RUNTIME | {"basin_sim"},  # the model: never the experiments that run it
    "basin_sim.experiments": RUNTIME | SIM,
    "basin_emulate": RUNTIME | SIM | {"basin_emulate"},
    "basin_loadgen": RUNTIME | SIM | {"basin_loadgen"},
    "basin_pipeline": RUNTIME | SIM | {"basin_pipeline"},
}
MAY_IMPORT["basin_stack"] = set(MAY_IMPORT) | {"basin_stack"}


def component_of(module: str) -> str:
    if module == "basin_sim.__main__":  # `python -m basin_sim` is the experiments' CLI
        return "basin_sim.experiments"
    for sub in ("basin_runtime.policy", "basin_runtime.gateway", "basin_sim.experiments"):
        if module == sub or module.startswith(sub + "."):
            return sub
    return module.partition(".")[0]


SOURCES = {module: path for package in OWN_PACKAGES for module, path in submodules(package).items()}


@dataclass(frozen=True)
class Import:
    target: str  # one of our modules
    line: int
    at_module_level: bool  # runs when the importing module is imported


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an `import from` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Our modules that one import statement loads, package `__init__`s on the way included."""
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
    else:
        base = resolve(module, is_package, node)
        named = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    loaded: set[str] = set()
    for name in named:
        parts = name.split(".")
        loaded.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    parents = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}  # already loaded
    return sorted(m for m in loaded if m in SOURCES and m != module and m not in parents)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import of our modules in `module`, marking those that run when it is imported."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(nodes: list[Any], at_module_level: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.extend(Import(t, node.lineno, at_module_level) for t in targets(module, is_package, node))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(node.body, False)
            elif isinstance(node, ast.If) and is_type_checking(node):
                visit(node.body, False)
                visit(node.orelse, at_module_level)
            else:  # class bodies, if/try/with/for/match blocks, except handlers and match cases run now
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    visit(getattr(node, field, []), at_module_level)

    visit(ast.parse(path.read_text(), str(path)).body, True)
    return found


IMPORTS = {module: imports_of(module, path) for module, path in SOURCES.items()}


def direction_violations(imports: dict[str, list[Import]]) -> list[str]:
    """One line per import of a component that the importing one may not use."""
    return [
        f"{module} imports {i.target} (line {i.line}; {component_of(module)} may import only "
        f"{sorted(MAY_IMPORT[component_of(module)])})"
        for module, found in imports.items()
        for i in found
        if component_of(i.target) not in MAY_IMPORT[component_of(module)]
    ]


def test_each_component_imports_only_the_components_below_it() -> None:
    assert set(MAY_IMPORT) == {component_of(m) for m in SOURCES}
    wrong = direction_violations(IMPORTS)
    assert not wrong, "\n".join(wrong)


def test_the_static_scan_sees_lazy_relative_and_type_only_imports(tmp_path: Path) -> None:
    source = tmp_path / "fake.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from .engine import Engine\n"
        "if TYPE_CHECKING:\n"
        "    from basin_emulate import config\n"
        "class Runner:\n"
        "    import basin_sim.experiments.cli\n"
        "    def run(self):\n"
        "        from basin_loadgen.replay import replay\n"
    )
    found = imports_of("basin_sim.fake", source)
    assert found == [
        Import("basin_sim.engine", 2, True),
        Import("basin_emulate", 4, False),
        Import("basin_emulate.config", 4, False),  # `from package import name` loads a submodule `name`
        Import("basin_sim.experiments", 6, True),
        Import("basin_sim.experiments.cli", 6, True),
        Import("basin_loadgen", 8, False),
        Import("basin_loadgen.replay", 8, False),
    ]
    assert [line.split(" (")[0] for line in direction_violations({"basin_sim.fake": found})] == [
        "basin_sim.fake imports basin_emulate",
        "basin_sim.fake imports basin_emulate.config",
        "basin_sim.fake imports basin_sim.experiments",  # the model never imports the experiments that run it
        "basin_sim.fake imports basin_sim.experiments.cli",
        "basin_sim.fake imports basin_loadgen",
        "basin_sim.fake imports basin_loadgen.replay",
    ]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected group of `graph`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan; the graphs here are a few hundred nodes deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            if len(group) > 1 or node in graph[node]:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [shortest_cycle(graph, min(group), group) for group in groups]


def shortest_cycle(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def test_module_level_imports_form_no_cycle() -> None:
    graph = {m: {i.target for i in imports if i.at_module_level} for m, imports in IMPORTS.items()}
    # the pair this test was written for
    assert "basin_sim.experiments.calibrate.commands" in graph["basin_sim.experiments.cli"]
    found = [" -> ".join(cycle) for cycle in cycles(graph)]
    assert not found, "module-level import cycles:\n" + "\n".join(found)


def test_basin_runtime_has_no_cycle_even_through_lazy_or_type_only_imports() -> None:
    """An import inside a function or an `if TYPE_CHECKING:` block still ties two modules together: in
    basin_runtime, what both sides need lives in a module below them (`gateway/memo.py`, `gateway/upstream.py`)."""
    ours = {m: imports for m, imports in IMPORTS.items() if m.split(".")[0] == "basin_runtime"}
    graph = {m: {i.target for i in imports if i.target in ours} for m, imports in ours.items()}
    assert "basin_runtime.gateway.memo" in graph["basin_runtime.gateway.calls"]  # a pair this test was written for
    found = [" -> ".join(cycle) for cycle in cycles(graph)]
    assert not found, "import cycles in basin_runtime (lazy and TYPE_CHECKING imports counted):\n" + "\n".join(found)


def test_no_package_has_a_cycle_even_through_lazy_or_type_only_imports() -> None:
    """Every package of ours at once, deferred imports counted (the Ray executor is imported lazily by the
    executor seam, so what both need lives below them in `basin_sim/experiments/jobs.py`)."""
    graph = {m: {i.target for i in imports} for m, imports in IMPORTS.items()}
    # a deferred import, counted
    assert "basin_sim.experiments.ray_executor" in graph["basin_sim.experiments.executors"]
    found = [" -> ".join(cycle) for cycle in cycles(graph)]
    assert not found, "import cycles (lazy and TYPE_CHECKING imports counted):\n" + "\n".join(found)


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(cycles(graph)) == [["a", "b", "c", "a"], ["e", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
