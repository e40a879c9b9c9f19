"""basin_sim and basin_emulate form no import cycle, not even through a function-level or TYPE_CHECKING
import; the few imports deferred into a function are deferred for their cost, never to dodge a cycle.

The import scan is tests/test_package_imports.py's (`ast`, every import of our modules, marked by whether
it runs when the module is imported).
"""

from __future__ import annotations

from tests.test_package_imports import IMPORTS, Import, cycles

PACKAGES = ("basin_sim", "basin_emulate")
# (importer, imported) -> why the import waits for the function that needs it.
DEFERRED = {
    ("basin_sim.experiments.cli", "basin_sim.experiments.plots"): "matplotlib, only for --plot-dir",
    ("basin_sim.experiments.compare", "basin_sim.experiments.plots"): "matplotlib, only for --plot-dir",
    ("basin_sim.experiments.executors", "basin_sim.experiments.ray_executor"):
        "Ray, only for --executor ray (basin[ray])",
    ("basin_sim.experiments.predictions", "basin_runtime"): "the package of the two below",
    ("basin_sim.experiments.predictions", "basin_runtime.predictor"): "onnxruntime, only where a predictor is loaded",
    ("basin_sim.experiments.predictions", "basin_runtime.model_files"):
        "onnxruntime, only where a predictor file is hashed",
}


def ours(module: str) -> bool:
    return module.partition(".")[0] in PACKAGES


def graph(imports: dict[str, list[Import]]) -> dict[str, set[str]]:
    """Every import among the packages' modules, deferred or not."""
    return {m: {i.target for i in found if ours(i.target)} for m, found in imports.items() if ours(m)}


def test_no_cycle_even_through_deferred_imports() -> None:
    found = [" -> ".join(cycle) for cycle in cycles(graph(IMPORTS))]
    assert not found, "import cycles (deferred imports included):\n" + "\n".join(found)


def test_the_graph_sees_a_cycle_made_only_of_a_deferred_import() -> None:
    planted = {**IMPORTS, "basin_sim.run_summary": [*IMPORTS["basin_sim.run_summary"],
                                                    Import("basin_sim.simulate", 1, False)]}
    assert ["basin_sim.run_summary", "basin_sim.simulate", "basin_sim.run_summary"] in cycles(graph(planted))


def test_every_deferred_import_has_its_reason() -> None:
    deferred = {(m, i.target) for m, found in IMPORTS.items() if ours(m) for i in found if not i.at_module_level}
    assert deferred == set(DEFERRED)
