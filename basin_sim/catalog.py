# The named files the simulator ships, and the files users write: profiles, deployments, scenarios.
# This module does file I/O; the model modules never call it.
#
# Rules:
# - A name is a file stem in its folder (`scenarios/surge-100.yaml` -> 'surge-100'); a path to a
#   .yaml file is accepted too. An unknown name raises `CatalogError` listing the known names.
# - Every file is checked whole: a missing or unknown key, or a value of the wrong kind, raises
#   `CatalogError` naming the file and the key (`bursts[1].kill_at_s`, not just "bad burst").
# - A deployment file: `profile` (name or file), `num_prefill`, `num_decode`, `cache` (gpu | host),
#   optional per-instance `prefill_cache_tokens`, `decode_kv_tokens`, `host_cache_tokens` (default:
#   the profile's whole KV pool, and its host tier when `cache` is host), optional SGLang decode
#   settings `decode_reserved_tokens`, `decode_clip_max_new_tokens`, `retraction_policy` (default:
#   SGLang's, see basin_sim/decode.py), optional `lending` (none | decode-memory; default none, what
#   stock SGLang does). Overload rates are not kept
#   here: they depend on the workload, and are measured on first use (calibrate/rates.py).
# - A scenario file: see basin_sim/workload/scenarios.py and the README's schema; each `rate`
#   segment gives `from_s` and exactly one of `x_overload` and `per_min` (the scenario names the
#   segment otherwise); `clients` holds `basin_sim.clients.ClientPolicy` fields.
"""Load profiles, deployments and scenarios by name or path, checking every key."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from basin_runtime.policy.lending import LENDING_KINDS, LendingKind
from basin_sim.clients import ClientError, ClientPolicy
from basin_sim.profile import CACHE_KINDS, CacheKind, Deployment, Profile, ProfileError
from basin_sim.workload import serving
from basin_sim.workload.scenarios import (
    BurstSpec,
    PopulationSpec,
    RateStep,
    Scenario,
    ScenarioError,
    WorkloadSpec,
)

PACKAGE_DIR = Path(__file__).resolve().parent
PROFILES_DIR = PACKAGE_DIR / "profiles"
DEPLOYMENTS_DIR = PACKAGE_DIR / "deployments"
SCENARIOS_DIR = PACKAGE_DIR / "scenarios"


class CatalogError(ValueError):
    """A named file that does not exist or does not hold what it should."""


@dataclass(frozen=True)
class DeploymentSpec:
    """A deployment file: instance counts, profile, cache kind and per-instance memories."""

    name: str
    path: Path
    profile: Profile
    num_prefill: int
    num_decode: int
    cache: CacheKind
    prefill_cache_tokens: int | None = None
    decode_kv_tokens: int | None = None
    host_cache_tokens: int | None = None
    server: dict[str, Any] = dataclasses.field(default_factory=dict)  # SGLang decode settings (_SERVER_KEYS)
    lending: LendingKind = "none"

    def build(self, cache: CacheKind | None = None, lending: LendingKind | None = None) -> Deployment:
        """The deployment, with the file's cache kind and lending unless `cache` / `lending` override them."""
        kind = self.cache if cache is None else cache
        try:
            base = Deployment.of(self.name, self.profile, self.num_prefill, self.num_decode, kind)
            host = base.host_cache_tokens if self.host_cache_tokens is None or kind == "gpu" else self.host_cache_tokens
            return dataclasses.replace(
                base, prefill_cache_tokens=self.prefill_cache_tokens or base.prefill_cache_tokens,
                decode_kv_tokens=self.decode_kv_tokens or base.decode_kv_tokens, host_cache_tokens=host,
                lending=self.lending if lending is None else lending, **self.server)
        except ProfileError as exc:
            raise CatalogError(f"{self.path}: {exc}") from exc


def names(folder: Path) -> list[str]:
    """The names of the YAML files in a catalog folder."""
    return sorted(p.stem for p in folder.glob("*.yaml") if "." not in p.stem)  # not *.measurements.yaml


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


_DEPLOYMENT_OPTIONAL = ("prefill_cache_tokens", "decode_kv_tokens", "host_cache_tokens")
_SERVER_KEYS = ("decode_reserved_tokens", "decode_clip_max_new_tokens", "retraction_policy")  # basin_sim/decode.py


def load_deployment(name: str) -> DeploymentSpec:
    """A deployment by name (or path), with its profile."""
    path = _resolve(DEPLOYMENTS_DIR, name, "deployment")
    data = _read(path, {"profile", "num_prefill", "num_decode", "cache"},
                 {"name", "lending", *_DEPLOYMENT_OPTIONAL, *_SERVER_KEYS})
    cache = data["cache"]
    if cache not in CACHE_KINDS:
        raise CatalogError(f"{path}: cache must be one of {list(CACHE_KINDS)}, got {cache!r}")
    lending = data.get("lending", "none")
    if lending not in LENDING_KINDS:
        raise CatalogError(f"{path}: lending must be one of {list(LENDING_KINDS)}, got {lending!r}")
    memories = {key: _whole(path, data, key) for key in _DEPLOYMENT_OPTIONAL if data.get(key) is not None}
    server: dict[str, Any] = {key: _whole(path, data, key) for key in _SERVER_KEYS[:2] if data.get(key) is not None}
    if data.get("retraction_policy") is not None:
        server["retraction_policy"] = str(data["retraction_policy"])
    spec = DeploymentSpec(str(data.get("name", path.stem)), path, load_profile(str(data["profile"])),
                          _whole(path, data, "num_prefill"), _whole(path, data, "num_decode"), cache, **memories,
                          server=server, lending=lending)
    spec.build()  # checks the counts and memories now, naming the file
    return spec


_SCENARIO_KEYS = ({"name", "duration_s", "warmup_s", "goodput_window"},
                  {"description", "rate", "population", "bursts", "workload", "clients"})


def load_scenario(name: str) -> Scenario:
    """A scenario by name (or path)."""
    path = _resolve(SCENARIOS_DIR, name, "scenario")
    data = _read(path, *_SCENARIO_KEYS)
    window = _fields(path, "goodput_window", data["goodput_window"], {"from_s": float, "to_s": float})
    rate = tuple(RateStep(**_fields(path, f"rate[{k}]", step, _RATE_FIELDS, optional={"x_overload", "per_min"}))
                 for k, step in enumerate(_items(path, "rate", data.get("rate"))))
    bursts = tuple(BurstSpec(**_fields(path, f"bursts[{k}]", b, _BURST_FIELDS, optional={"kill_at_s"}))
                   for k, b in enumerate(_items(path, "bursts", data.get("bursts"))))
    population = None
    if data.get("population") is not None:
        population = PopulationSpec(**_fields(path, "population", data["population"], {"agents": int,
                                                                                       "think_s": float},
                                              optional={"think_s"}))
    clients = data.get("clients") or {}
    if not isinstance(clients, Mapping):
        raise CatalogError(f"{path}: clients must be a mapping, got {clients!r}")
    try:
        client_policy = ClientPolicy(**clients)
    except TypeError as exc:
        known = [f.name for f in dataclasses.fields(ClientPolicy)]
        unknown = sorted(set(clients) - set(known))
        raise CatalogError(f"{path}: clients: unknown key(s) {unknown}; known: {known}") from exc
    except ClientError as exc:
        raise CatalogError(f"{path}: clients: {exc}") from exc
    try:
        return Scenario(
            name=str(data["name"]), description=str(data.get("description", "")),
            duration_s=_number(path, data, "duration_s"), warmup_s=_number(path, data, "warmup_s"),
            goodput_from_s=window["from_s"], goodput_to_s=window["to_s"], rate=rate, population=population,
            bursts=bursts, workload=_workload(path, data.get("workload")), clients=client_policy)
    except ScenarioError as exc:
        raise CatalogError(f"{path}: {exc}") from exc


_RATE_FIELDS: dict[str, type] = {"from_s": float, "x_overload": float, "per_min": float}  # one of the last two
_BURST_FIELDS: dict[str, type] = {"from_s": float, "to_s": float, "x_base": float, "max_unloaded_s": float,
                                  "kill_at_s": float}


def _workload(path: Path, raw: object) -> WorkloadSpec:
    if raw is None:
        return WorkloadSpec()
    kinds = {"benchmarks": list, "preset": str, "tool_time_scale": float, "timing": str, "reasoning_scale": float,
             "harness_scale": float, "median_peak_tokens": float}
    values = _fields(path, "workload", raw, kinds, optional=set(kinds))
    benchmarks = values.get("benchmarks")
    if benchmarks is not None:
        if not benchmarks or not all(isinstance(b, str) for b in benchmarks):
            raise CatalogError(f"{path}: workload.benchmarks must be a non-empty list of names, got {benchmarks!r}")
        values["benchmarks"] = tuple(benchmarks)
    workload = WorkloadSpec(**values)
    if workload.timing != serving.RECORDED:
        try:
            serving.load_timing(workload.timing, workload.reasoning_scale, workload.harness_scale)
        except serving.TimingError as exc:
            raise CatalogError(f"{path}: workload.timing: {exc}") from exc
    elif workload.reasoning_scale is not None or workload.harness_scale is not None:
        raise CatalogError(f"{path}: workload.reasoning_scale and harness_scale need a serving timing "
                           f"(workload.timing, one of {serving.known_timings()})")
    return workload


def _items(path: Path, key: str, raw: object) -> list[object]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise CatalogError(f"{path}: {key} must be a list, got {raw!r}")
    return raw


def _fields(path: Path, where: str, raw: object, kinds: Mapping[str, type],
            optional: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    """The keys of one mapping, each of its kind (float accepts whole numbers); unknown keys refused."""
    if not isinstance(raw, Mapping):
        raise CatalogError(f"{path}: {where} must be a mapping, got {raw!r}")
    missing = set(kinds) - set(optional) - set(raw)
    unknown = set(raw) - set(kinds)
    if missing or unknown:
        raise CatalogError(f"{path}: {where}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
                           f"known: {sorted(kinds)}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        kind = kinds[key]
        if value is None and key in optional:
            continue
        if kind is float:
            is_ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if is_ok else value
        else:
            is_ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not is_ok:
            raise CatalogError(f"{path}: {where}.{key} must be a {kind.__name__}, got {value!r}")
        values[key] = value
    return values
