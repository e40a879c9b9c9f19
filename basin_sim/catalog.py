# The named files the simulator ships: profiles, deployments and scenarios (YAML under basin_sim/).
# This module does file I/O; the model modules never call it.
#
# Rules:
# - A name is a file stem in its folder (`scenarios/surge-100.yaml` -> 'surge-100'); a path to a
#   .yaml file is accepted too. An unknown name raises `CatalogError` listing the known names.
# - Every file is checked whole: a missing or unknown key, or a value of the wrong kind, raises
#   `CatalogError` naming the file and the key.
# - A deployment names its profile and records the overload rate measured for each cache kind and
#   workload ('table': the real session table; 'synthetic': the synthetic corpus) by
#   `python -m basin_sim calibrate --write` (which rewrites just that line of the file).
"""Load profiles, deployments and scenarios by name; record calibrated overload rates."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from basin_sim.profile import CACHE_KINDS, CacheKind, Deployment, Profile, ProfileError
from basin_sim.workload.scenarios import Burst, Scenario, ScenarioError, Surge

PACKAGE_DIR = Path(__file__).resolve().parent
PROFILES_DIR = PACKAGE_DIR / "profiles"
DEPLOYMENTS_DIR = PACKAGE_DIR / "deployments"
SCENARIOS_DIR = PACKAGE_DIR / "scenarios"


WORKLOADS = ("table", "synthetic")


def rate_key(cache: CacheKind, workload: str) -> str:
    """The deployment-file key holding the overload rate for this cache kind and workload."""
    return f"overload_rate_{cache}_per_s" if workload == "table" else f"overload_rate_{cache}_{workload}_per_s"


class CatalogError(ValueError):
    """A named file that does not exist or does not hold what it should."""


@dataclass(frozen=True)
class DeploymentSpec:
    """A deployment file: instance counts, profile, measured overload rates per cache kind and workload."""

    name: str
    path: Path
    profile: Profile
    num_prefill: int
    num_decode: int
    overload_rate_per_s: dict[str, float | None]  # by `rate_key`

    def build(self, cache: CacheKind) -> Deployment:
        """The deployment with a GPU-only cache or with the host tier."""
        return Deployment.of(self.name, self.profile, self.num_prefill, self.num_decode, cache)

    def overload_rate(self, cache: CacheKind, workload: str) -> float:
        """The calibrated overload rate; a clear error if it was never measured."""
        key = rate_key(cache, workload)
        rate = self.overload_rate_per_s[key]
        if rate is None:
            raise CatalogError(f"{self.path}: {key} is not calibrated; run python -m basin_sim calibrate "
                               f"--deployment {self.name} --cache {cache} --write (with the same workload)")
        return rate


def names(folder: Path) -> list[str]:
    """The names of the YAML files in a catalog folder."""
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _resolve(folder: Path, name: str, kind: str) -> Path:
    if name.endswith((".yaml", ".yml")):
        path = Path(name)
        if not path.is_file():
            raise CatalogError(f"{kind} file {path} does not exist")
        return path
    path = folder / f"{name}.yaml"
    if not path.is_file():
        raise CatalogError(f"unknown {kind} {name!r}; known {kind}s: {', '.join(names(folder))}")
    return path


def _read(path: Path, required: set[str], optional: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: expected a mapping of keys to values")
    missing, unknown = required - data.keys(), data.keys() - required - optional
    if missing or unknown:
        raise CatalogError(f"{path}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
    return data


def _number(path: Path, data: dict[str, Any], key: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CatalogError(f"{path}: {key} must be a number, got {value!r}")
    return float(value)


def _whole(path: Path, data: dict[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise CatalogError(f"{path}: {key} must be a whole number, got {value!r}")
    return value


def load_profile(name: str) -> Profile:
    """A profile by name (or path)."""
    path = _resolve(PROFILES_DIR, name, "profile")
    fields = {f.name: f.type for f in dataclasses.fields(Profile)}
    data = _read(path, set(fields))
    values: dict[str, Any] = {"name": str(data["name"])}
    for key, kind in fields.items():
        if key != "name":
            values[key] = _whole(path, data, key) if kind == "int" else _number(path, data, key)
    try:
        return Profile(**values)
    except ProfileError as exc:
        raise CatalogError(f"{path}: {exc}") from exc


def load_deployment(name: str) -> DeploymentSpec:
    """A deployment by name (or path), with its profile."""
    path = _resolve(DEPLOYMENTS_DIR, name, "deployment")
    keys = {rate_key(cache, workload) for cache in CACHE_KINDS for workload in WORKLOADS}
    data = _read(path, {"name", "profile", "num_prefill", "num_decode", *keys})
    rates = {key: None if data[key] is None else _number(path, data, key) for key in sorted(keys)}
    return DeploymentSpec(str(data["name"]), path, load_profile(str(data["profile"])),
                          _whole(path, data, "num_prefill"), _whole(path, data, "num_decode"), rates)


def write_overload_rate(spec: DeploymentSpec, cache: CacheKind, workload: str, rate_per_s: float,
                        note: str) -> None:
    """Rewrite the deployment file's overload-rate line for `cache` and `workload`, keeping every other line."""
    key = rate_key(cache, workload)
    text = spec.path.read_text()
    line = f"{key}: {rate_per_s:.4f}  # {note}"
    new, count = re.subn(rf"^{key}:.*$", line, text, flags=re.MULTILINE)
    if count != 1:
        raise CatalogError(f"{spec.path}: expected one line starting with {key}:, found {count}")
    spec.path.write_text(new)


def load_scenario(name: str) -> Scenario:
    """A scenario by name (or path)."""
    path = _resolve(SCENARIOS_DIR, name, "scenario")
    data = _read(path, {"name", "description", "duration_s", "warmup_s", "window_start_s"},
                 {"load_fraction", "surge", "burst"})
    try:
        return Scenario(
            name=str(data["name"]), description=str(data["description"]),
            duration_s=_number(path, data, "duration_s"), warmup_s=_number(path, data, "warmup_s"),
            window_start_s=_number(path, data, "window_start_s"),
            load_fraction=_number(path, data, "load_fraction") if "load_fraction" in data else 0.5,
            surge=_part(path, data, "surge", Surge), burst=_part(path, data, "burst", Burst),
        )
    except ScenarioError as exc:
        raise CatalogError(f"{path}: {exc}") from exc


def _part(path: Path, data: dict[str, Any], key: str, cls: type[Surge] | type[Burst]) -> Any:
    part = data.get(key)
    if part is None:
        return None
    kinds = {f.name: f.type for f in dataclasses.fields(cls)}
    if not isinstance(part, dict) or set(part) != set(kinds):
        raise CatalogError(f"{path}: {key} must be a mapping with exactly the keys {sorted(kinds)}, got {part!r}")
    for name, kind in kinds.items():
        value = part[name]
        ok = isinstance(value, bool) if kind == "bool" else (
            not isinstance(value, bool) and isinstance(value, int if kind == "int" else (int, float)))
        if not ok:
            raise CatalogError(f"{path}: {key}.{name} must be a {kind}, got {value!r}")
    return cls(**part)
