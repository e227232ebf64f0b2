"""Type stubs of the Rust extension module ``deeppart._planner``."""

from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from typing import Any, Final, Literal, TypedDict, final

from typing_extensions import Buffer

__all__ = [
    "ALGORITHMS",
    "PLANNER_VERSION",
    "REPLICA_DIGEST_LEN",
    "CacheError",
    "CacheWarning",
    "CostModel",
    "DeepPartError",
    "ErasureError",
    "Manifest",
    "ManifestError",
    "Plan",
    "PlanCache",
    "PlanError",
    "PlanStats",
    "Topology",
    "default_cache_dir",
    "differing_leaves",
    "plan",
    "plan_fingerprint",
    "replica_digests",
    "rs_encode",
    "rs_reconstruct",
]

PLANNER_VERSION: Final[str]
ALGORITHMS: Final[list[str]]
REPLICA_DIGEST_LEN: Final[int]

PathKey = str | int
Algorithm = Literal["balanced", "lpt", "greedy", "deeppart"]
PlanSource = Literal["computed", "memory", "disk", "service", "service-cache", "local-fallback"]

class DeepPartError(Exception): ...
class ManifestError(DeepPartError): ...
class PlanError(DeepPartError): ...
class CacheError(DeepPartError): ...
class ErasureError(DeepPartError): ...
class CacheWarning(UserWarning): ...

@final
class Manifest:
    @staticmethod
    def from_json(text: str) -> Manifest: ...
    @staticmethod
    def from_leaves(leaves: Iterable[Mapping[str, Any]]) -> Manifest: ...
    @staticmethod
    def from_state_dict(state: Any) -> Manifest: ...
    def to_json(self) -> str: ...
    def leaves(self) -> list[dict[str, Any]]: ...
    def paths(self) -> list[tuple[PathKey, ...]]: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def fingerprint(self) -> str: ...
    def __len__(self) -> int: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class CostModel:
    def __new__(
        cls,
        *,
        fixed_s: float | None = None,
        piece_s: float | None = None,
        bandwidth: float | None = None,
        writer_s: float | None = None,
        min_piece_bytes: int | None = None,
        align_bytes: int | None = None,
        grain: Literal["element", "row"] | None = None,
        node_bandwidth: float | None = None,
        aggregate_bandwidth: float | None = None,
    ) -> CostModel: ...
    @property
    def fixed_s(self) -> float: ...
    @property
    def piece_s(self) -> float: ...
    @property
    def bandwidth(self) -> float: ...
    @property
    def writer_s(self) -> float: ...
    @property
    def min_piece_bytes(self) -> int: ...
    @property
    def align_bytes(self) -> int: ...
    @property
    def grain(self) -> Literal["element", "row"]: ...
    @property
    def node_bandwidth(self) -> float | None: ...
    @property
    def aggregate_bandwidth(self) -> float | None: ...
    def to_dict(self) -> dict[str, Any]: ...

@final
class Topology:
    def __new__(cls, ranks_per_node: int = 1) -> Topology: ...
    @property
    def ranks_per_node(self) -> int: ...

@final
class PlanStats:
    @property
    def makespan(self) -> float: ...
    @property
    def lower_bound(self) -> float: ...
    @property
    def gap(self) -> float: ...
    @property
    def pieces(self) -> int: ...
    @property
    def splits(self) -> int: ...
    @property
    def writers(self) -> int: ...
    @property
    def max_rank_bytes(self) -> int: ...
    @property
    def plan_ms(self) -> float: ...
    @property
    def source(self) -> PlanSource: ...
    def to_dict(self) -> dict[str, float | int | str]: ...

@final
class Plan:
    def with_source(self, source: PlanSource) -> Plan: ...
    @property
    def world_size(self) -> int: ...
    @property
    def algorithm(self) -> Algorithm: ...
    @property
    def fingerprint(self) -> str: ...
    def assignment_digest(self) -> str: ...
    @property
    def manifest(self) -> Manifest: ...
    @property
    def cost(self) -> CostModel: ...
    @property
    def topology(self) -> Topology: ...
    @property
    def stats(self) -> PlanStats: ...
    def rank_pieces(self, rank: int) -> list[tuple[int, int, int]]: ...
    def pieces(self, rank: int) -> list[tuple[tuple[PathKey, ...], int, int]]: ...
    def rank_bytes(self) -> list[int]: ...
    def rank_costs(self) -> list[float]: ...
    def to_json(self) -> str: ...
    @staticmethod
    def from_pieces(
        manifest: Manifest,
        world_size: int,
        ranks: list[list[tuple[int, int, int]]],
        *,
        algorithm: str = "balanced",
        cost: CostModel | None = None,
        topology: Topology | None = None,
        plan_ms: float = 0.0,
    ) -> Plan: ...
    @staticmethod
    def from_json(text: str) -> Plan: ...

def plan(
    manifest: Manifest,
    world_size: int,
    *,
    algorithm: str = "balanced",
    cost: CostModel | None = None,
    topology: Topology | None = None,
    cache: PlanCache | None = None,
) -> Plan: ...

def plan_fingerprint(
    manifest: Manifest,
    world_size: int,
    *,
    algorithm: str = "balanced",
    cost: CostModel | None = None,
    topology: Topology | None = None,
) -> str: ...

class _CacheStats(TypedDict):
    hits_memory: int
    hits_disk: int
    misses: int
    evictions: int
    memory_evictions: int
    discarded: int
    stale: int
    memory_entries: int
    entries: int
    bytes: int
    disk: str
    directory: str | None

class _VerifyReport(TypedDict):
    entries: int
    valid: int
    discarded: int
    other_version: int

@final
class PlanCache:
    def __new__(
        cls,
        directory: str | PathLike[str] | None = None,
        *,
        memory_entries: int = 64,
        max_bytes: int = 536870912,
        disk: bool = True,
        planner_version: str | None = None,
    ) -> PlanCache: ...
    @property
    def directory(self) -> str | None: ...
    @property
    def path(self) -> str | None: ...
    @property
    def memory_entries(self) -> int: ...
    @property
    def max_bytes(self) -> int: ...
    def get(
        self,
        manifest: Manifest,
        world_size: int,
        *,
        algorithm: str = "balanced",
        cost: CostModel | None = None,
        topology: Topology | None = None,
    ) -> Plan | None: ...
    def put(self, plan: Plan) -> bool: ...
    def stats(self) -> _CacheStats: ...
    def clear(self) -> int: ...
    def verify(self) -> _VerifyReport: ...

def default_cache_dir() -> str | None: ...

# Reed-Solomon erasure coding (deeppart_planner::erasure). Shards are any
# C-contiguous buffers, read as raw bytes. Parity shards have the longest
# data length rounded up to even; reconstruction needs the data lengths.
# (numpy's stubs declare ndarray a Buffer only for Python >= 3.12: under
# 3.11, pass array.data, a memoryview without a copy.)
def rs_encode(shards: Iterable[Buffer], parity: int) -> list[bytes]: ...
def rs_reconstruct(
    original_count: int,
    parity_count: int,
    originals: Mapping[int, Buffer],
    parity: Mapping[int, Buffer],
    lengths: Sequence[int],
) -> list[bytes]: ...

# Replica digests (deeppart_planner::replica): 16-byte BLAKE3 digests of
# leaf buffers, hashed with the GIL released, and the leaves on which ranks'
# digests differ, with the ranks that differ from the majority.
def replica_digests(buffers: Iterable[Buffer], threads: int = 1) -> bytes: ...
def differing_leaves(per_rank: Sequence[bytes], leaves: int) -> list[tuple[int, list[int]]]: ...
