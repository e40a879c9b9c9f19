"""Load profiles, deployments and scenarios by name or path, checking every key.

The named files the simulator ships, and the files users write: profiles, deployments, scenarios.
This module does file I/O; the model modules never call it.

Rules:
- A name is a file stem in its folder (`scenarios/surge-100.yaml` -> 'surge-100'); a path to a
  .yaml file is accepted too. An unknown name raises `CatalogError` listing the known names.
- Every file is checked whole, by `basin_runtime.schema` against its declared keys (`DEPLOYMENT_KEYS`,
  `SCENARIO_KEYS`; a profile's are `Profile`'s fields, their kinds its annotations): a missing or unknown
  key, or a value of the wrong kind, raises `CatalogError` naming the file and the key
  (`bursts[1].kill_at_s`, not just "bad burst"). A null optional key is absent.
- A deployment file: `profile` (name or file), `num_prefill`, `num_decode`, `cache` (gpu | host),
  optional per-instance `prefill_cache_tokens`, `decode_kv_tokens`, `host_cache_tokens` (default:
  the profile's whole KV pool, and its host tier when `cache` is host), optional SGLang decode
  settings `decode_reserved_tokens`, `decode_clip_max_new_tokens`, `retraction_policy` (default:
  SGLang's, see basin_sim/decode.py), optional `lending` (none | decode-memory | storage-offload; default none, what
  stock SGLang does), optional `session_radix_cache` (false | faithful | true; default false: SGLang's
  session-aware radix cache, basin_sim/radix_cache.py). Overload rates are not kept
  here: they depend on the workload, and are measured on first use (calibrate/rates.py).
- A scenario file: see basin_sim/workload/scenarios.py and the README's schema; each `rate`
  segment gives `from_s` and exactly one of `x_overload` and `per_min` (the scenario names the
  segment otherwise); `clients` holds `basin_sim.clients.ClientPolicy` fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from basin_runtime.policy.lending import LENDING_KINDS, LendingKind
from basin_runtime.schema import (
    Anything,
    Key,
    ListOf,
    Number,
    OneOf,
    Record,
    SchemaError,
    Section,
    Text,
    Whole,
    declared,
    read_keys,
)
from basin_sim.clients import ClientError, ClientPolicy
from basin_sim.profile import (
    CACHE_KINDS,
    SESSION_RADIX_CACHE_KINDS,
    CacheKind,
    Deployment,
    Profile,
    ProfileError,
    SessionRadixCache,
)
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
    session_radix_cache: SessionRadixCache = False

    def build(self, cache: CacheKind | None = None, lending: LendingKind | None = None,
              session_radix_cache: SessionRadixCache | None = None) -> Deployment:
        """The deployment, with the file's cache kind, lending and session radix cache unless overridden."""
        kind = self.cache if cache is None else cache
        session_cache = self.session_radix_cache if session_radix_cache is None else session_radix_cache
        try:
            base = Deployment.of(self.name, self.profile, self.num_prefill, self.num_decode, kind)
            host = base.host_cache_tokens if self.host_cache_tokens is None or kind == "gpu" else self.host_cache_tokens
            return dataclasses.replace(
                base, prefill_cache_tokens=self.prefill_cache_tokens or base.prefill_cache_tokens,
                decode_kv_tokens=self.decode_kv_tokens or base.decode_kv_tokens, host_cache_tokens=host,
                lending=self.lending if lending is None else lending, session_radix_cache=session_cache, **self.server)
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


def _read(path: Path, keys: Mapping[str, Key], required: Collection[str]) -> dict[str, Any]:
    """The file's mapping, every key declared in `keys` and checked (`basin_runtime.schema`); null optional
    keys left out. `CatalogError` naming the file, the key and the value."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: expected a mapping of keys to values")
    try:
        return read_keys(data, keys, required, null_is_absent=True)
    except SchemaError as exc:
        raise CatalogError(f"{path}: {exc}") from None


def load_profile(name: str) -> Profile:
    """A profile by name (or path): every field of `Profile`, each of its annotated kind."""
    path = _resolve(PROFILES_DIR, name, "profile")
    values = _read(path, declared(Profile), [f.name for f in dataclasses.fields(Profile)])
    try:
        return Profile(**values)
    except ProfileError as exc:
        raise CatalogError(f"{path}: {exc}") from exc


_TOKENS = Whole()
_SERVER_KEYS = ("decode_reserved_tokens", "decode_clip_max_new_tokens", "retraction_policy")  # basin_sim/decode.py
DEPLOYMENT_KEYS: dict[str, Key] = {
    "name": Key(Text(), "the deployment's name (default: the file's stem)"),
    "profile": Key(Text(), "a profile name, or a path to a .yaml file"),
    "num_prefill": Key(Whole(), "prefill instances"),
    "num_decode": Key(Whole(), "decode instances"),
    "cache": Key(OneOf(CACHE_KINDS), "where the prefix cache lives"),
    "lending": Key(OneOf(LENDING_KINDS), "the lending switch (default none, as stock SGLang)"),
    "session_radix_cache": Key(OneOf(SESSION_RADIX_CACHE_KINDS),
                               "SGLang's session-aware radix cache on prefill (default false; faithful: as "
                               "SGLang's code under PD, inert; true: its intended semantics, hypothetical)"),
    "prefill_cache_tokens": Key(_TOKENS, "per prefill instance (default: the profile's KV pool)", "tokens"),
    "decode_kv_tokens": Key(_TOKENS, "per decode instance (default: the profile's KV pool)", "tokens"),
    "host_cache_tokens": Key(_TOKENS, "per instance, with cache: host (default: the profile's host tier)", "tokens"),
    "decode_reserved_tokens": Key(_TOKENS, "SGLang's decode reservation (default: SGLang's)", "tokens"),
    "decode_clip_max_new_tokens": Key(_TOKENS, "SGLang's clip of max_new_tokens (default: SGLang's)", "tokens"),
    "retraction_policy": Key(Text(), "SGLang's retraction order (default: SGLang's)"),
}


def load_deployment(name: str) -> DeploymentSpec:
    """A deployment by name (or path), with its profile."""
    path = _resolve(DEPLOYMENTS_DIR, name, "deployment")
    data = _read(path, DEPLOYMENT_KEYS, ("profile", "num_prefill", "num_decode", "cache"))
    memories = {key: data[key] for key in ("prefill_cache_tokens", "decode_kv_tokens", "host_cache_tokens")
                if key in data}
    server = {key: data[key] for key in _SERVER_KEYS if key in data}
    spec = DeploymentSpec(data.get("name", path.stem), path, load_profile(data["profile"]), data["num_prefill"],
                          data["num_decode"], data["cache"], **memories, server=server,
                          lending=data.get("lending", "none"),
                          session_radix_cache=data.get("session_radix_cache", False))
    spec.build()  # checks the counts and memories now, naming the file
    return spec


_SECONDS = Number()
SCENARIO_KEYS: dict[str, Key] = {
    "name": Key(Text(), "the scenario's name"),
    "description": Key(Anything(), "free text"),
    "duration_s": Key(_SECONDS, "simulated time", "s"),
    "warmup_s": Key(_SECONDS, "arrivals before time 0 that fill the system", "s"),
    "goodput_window": Key(Section({"from_s": Key(_SECONDS, unit="s"), "to_s": Key(_SECONDS, unit="s")},
                                  ("from_s", "to_s")), "where goodput is counted"),
    "rate": Key(ListOf(Record(RateStep, null_is_absent=True)), "arrival rate segments (scenarios.py)"),
    "population": Key(Record(PopulationSpec, null_is_absent=True), "a closed population instead of a rate"),
    "bursts": Key(ListOf(Record(BurstSpec, null_is_absent=True)), "extra sessions over a window"),
    "workload": Key(Record(WorkloadSpec, null_is_absent=True), "which sessions and timing are replayed"),
    "clients": Key(Section({f.name: Key(Anything()) for f in dataclasses.fields(ClientPolicy)}),
                   "ClientPolicy fields (checked by ClientPolicy)"),
}


def load_scenario(name: str) -> Scenario:
    """A scenario by name (or path)."""
    path = _resolve(SCENARIOS_DIR, name, "scenario")
    data = _read(path, SCENARIO_KEYS, ("name", "duration_s", "warmup_s", "goodput_window"))
    window = data["goodput_window"]
    try:
        client_policy = ClientPolicy(**data.get("clients", {}))
    except ClientError as exc:
        raise CatalogError(f"{path}: clients: {exc}") from exc
    try:
        return Scenario(
            name=data["name"], description=str(data.get("description", "")), duration_s=data["duration_s"],
            warmup_s=data["warmup_s"], goodput_from_s=window["from_s"], goodput_to_s=window["to_s"],
            rate=data.get("rate", ()), population=data.get("population"), bursts=data.get("bursts", ()),
            workload=_workload(path, data.get("workload", WorkloadSpec())), clients=client_policy)
    except ScenarioError as exc:
        raise CatalogError(f"{path}: {exc}") from exc


def _workload(path: Path, workload: WorkloadSpec) -> WorkloadSpec:
    """The workload, its serving timing checked (`TimingError` named as the file's `workload.timing`)."""
    if workload.benchmarks is not None and not workload.benchmarks:
        raise CatalogError(f"{path}: workload.benchmarks must be a non-empty list of names, got []")
    if workload.timing != serving.RECORDED:
        try:
            serving.check_timing(workload.timing, workload.reasoning_scale)
        except serving.TimingError as exc:
            raise CatalogError(f"{path}: workload.timing: {exc}") from exc
    elif workload.reasoning_scale is not None:
        raise CatalogError(f"{path}: workload.reasoning_scale needs a serving timing "
                           f"(workload.timing, one of {serving.known_timings()})")
    return workload
