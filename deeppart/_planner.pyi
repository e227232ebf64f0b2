"""Type stubs of the Rust extension module ``deeppart._planner``.

Hand-written; ``tests/planner/test_stubs.py`` checks them against the compiled
module with mypy's stubtest. Every class, exception and function is
documented here, as the binding (``bindings/src``) defines it; the model and
the algorithms are described in docs/PLANNER.md."""

from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from typing import Any, Final, Literal, TypedDict, final

from typing_extensions import Buffer

__all__ = [
    "ALGORITHMS",
    "MAX_GROUPS",
    "MAX_GROUP_ENTRIES",
    "MAX_GROUP_RANK",
    "PLANNER_VERSION",
    "REPLICA_DIGEST_LEN",
    "STREAMING_MIN_BYTES",
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
    "copy_into",
    "default_cache_dir",
    "differing_leaves",
    "model_time",
    "plan",
    "plan_fingerprint",
    "replica_digests",
    "rs_encode",
    "rs_reconstruct",
    "write_hashed",
    "xxh3_64",
]

PLANNER_VERSION: Final[str]
ALGORITHMS: Final[list[str]]
REPLICA_DIGEST_LEN: Final[int]
STREAMING_MIN_BYTES: Final[int]
#: A manifest's limits on holder groups (docs/SECURITY.md): at most
#: ``MAX_GROUPS`` groups, ``MAX_GROUP_ENTRIES`` ranks listed in all of them
#: together, every rank below ``MAX_GROUP_RANK``.
MAX_GROUPS: Final[int]
MAX_GROUP_ENTRIES: Final[int]
MAX_GROUP_RANK: Final[int]

PathKey = str | int
Algorithm = Literal["balanced", "lpt", "greedy", "deeppart"]
PlanSource = Literal["computed", "memory", "disk", "service", "service-cache", "local-fallback"]

class DeepPartError(Exception):
    """Base class of DeepPart's errors: every error the extension raises
    derives from it (a ``TypeError`` or ``ValueError`` for an argument of the
    wrong type or a value out of its Python range excepted)."""

class ManifestError(DeepPartError):
    """A manifest is malformed or invalid: bad JSON, an unknown dtype or key,
    a shape whose size overflows, a duplicate or empty path, a leaf
    description of an unsupported type or nested too deeply. The message
    names the leaf."""

class PlanError(DeepPartError):
    """A plan cannot be computed or accepted: a world size or topology out of
    range, an invalid cost model, an unknown algorithm, an owner or a holder
    group's rank outside the world, an algorithm that does not plan holder
    groups (``deeppart``), or a plan (from JSON, pieces, a service or the
    cache) whose pieces do not cover every leaf exactly once, put a piece on
    a rank that does not hold its leaf, or whose fingerprint does not match
    its inputs."""

class CacheError(DeepPartError):
    """The plan cache's disk store cannot be opened, read or written, in
    ``PlanCache.clear`` and ``PlanCache.verify``. Planning through a cache
    never raises it: a faulty cache is bypassed with a ``CacheWarning``."""

class ErasureError(DeepPartError):
    """Reed-Solomon parity cannot be computed (``rs_encode``), or the
    surviving shards cannot restore the data (``rs_reconstruct``)."""

class CacheWarning(UserWarning):
    """The plan cache was bypassed, rebuilt or had an entry discarded;
    planning went on. A warning filter that turns it into an error is
    ignored: the cache never fails a planning call."""

@final
class Manifest:
    """An ordered list of the leaves of a state tree: paths, dtypes, shapes,
    sizes and holders (every rank, an owner, or a holder group). Immutable;
    equal manifests have equal fingerprints."""

    @staticmethod
    def from_json(text: str) -> Manifest:
        """Parses the JSON interchange form (docs/PLANNER.md), with the GIL
        released. Raises ``ManifestError``."""
    @staticmethod
    def from_leaves(
        leaves: Iterable[Mapping[str, Any]],
        groups: Sequence[Sequence[int]] | None = None,
        tables: Sequence[Sequence[Sequence[Any]]] | None = None,
        shard_key: str | None = None,
    ) -> Manifest:
        """Builds a manifest from leaf descriptions: dicts with the keys of
        the JSON form (``path``, ``dtype`` and ``shape``, or ``kind="object"``
        and ``nbytes``; optional ``owner``, or ``holders``: an index into
        ``groups``), validated exactly like JSON. ``groups`` are the holder
        groups, each a sorted list of distinct ranks (a leaf with
        ``holders=i`` is held, with identical bytes, by exactly the ranks of
        ``groups[i]``; one without ``owner`` or ``holders`` by every rank).
        ``tables``: shard tables, each a list of ``[shape, owner, holders]``
        (owner and holders None or ints, as above); an item ``{"path": P,
        "dtype": D, "table": t}`` stands for one tensor leaf per row ``k``
        of table ``t``, at path ``P + [shard_key, k]`` (the shards of one
        DTensor, described once per layout). Raises ``ManifestError``
        naming the leaf, table or group."""
    @staticmethod
    def from_state_dict(state: Any) -> Manifest:
        """Walks nested dicts, lists and tuples of torch tensors and plain
        values (e.g. a model and an optimizer state_dict) without copying
        tensor data (``deeppart.state.state.describe_leaves``, then
        ``from_leaves``). Raises ``ManifestError``."""
    def to_json(self) -> str:
        """The JSON interchange form, what ``from_json``, ``deeppart plan``
        and ``deeppart simulate --model FILE`` read."""
    def leaves(self) -> list[dict[str, Any]]:
        """Leaf descriptions as dicts (``path``, ``kind``, ``dtype``,
        ``shape``, ``nbytes``, ``owner``, ``holders``: a group index or
        None), in manifest order."""
    @property
    def groups(self) -> list[list[int]]:
        """The holder groups (each a sorted list of distinct ranks) that the
        leaves' ``holders`` index; empty for a manifest without groups."""
    def paths(self) -> list[tuple[PathKey, ...]]:
        """Leaf paths as tuples, in manifest order."""
    @property
    def total_bytes(self) -> int:
        """Bytes of all leaves."""
    @property
    def fingerprint(self) -> str:
        """Hex blake3 hash of the structure (paths, kinds, dtypes, shapes,
        sizes, owners, holder groups), computed on first use."""
    def __len__(self) -> int:
        """The number of leaves."""
    def __eq__(self, other: object, /) -> bool:
        """The same leaves (paths, kinds, dtypes, shapes, sizes, owners);
        False for anything that is not a manifest."""
    def __hash__(self) -> int:
        """The first 64 bits of the fingerprint."""

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
    ) -> CostModel:
        """A cost model; a parameter left ``None`` keeps its default
        (docs/PLANNER.md's table). Raises ``PlanError`` for a value out of
        range (negative or non-finite times, a bandwidth that is not
        positive and finite, ``min_piece_bytes`` or ``align_bytes`` 0, a
        grain other than "element" or "row")."""
    @property
    def fixed_s(self) -> float:
        """Seconds paid once by every rank that writes (open, fsync, close)."""
    @property
    def piece_s(self) -> float:
        """Seconds paid for every piece a rank writes."""
    @property
    def bandwidth(self) -> float:
        """Sustained write bandwidth of one rank, bytes per second."""
    @property
    def writer_s(self) -> float:
        """Per-file metadata seconds, paid once per writer and serialised
        over all writers."""
    @property
    def min_piece_bytes(self) -> int:
        """The planner never cuts a tensor into a smaller piece."""
    @property
    def align_bytes(self) -> int:
        """With grain "element", cuts fall on multiples of this many bytes
        into a tensor."""
    @property
    def grain(self) -> Literal["element", "row"]:
        """Where cuts may fall: any aligned element, or whole dim-0 rows."""
    @property
    def node_bandwidth(self) -> float | None:
        """Write bandwidth of one node, shared by its ranks; None: unlimited."""
    @property
    def aggregate_bandwidth(self) -> float | None:
        """Write bandwidth of the storage, shared by all writers; None: unlimited."""
    def to_dict(self) -> dict[str, Any]:
        """The parameters as a dict of keyword arguments of ``CostModel``."""

@final
class Topology:
    """How ranks sit on nodes: ranks ``[n*ranks_per_node, (n+1)*ranks_per_node)``
    share node ``n``."""

    def __new__(cls, ranks_per_node: int = 1) -> Topology:
        """Raises ``PlanError`` unless ``1 <= ranks_per_node < 2**32``; a
        plan's world size must be a multiple of it."""
    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node."""

@final
class PlanStats:
    """Quality figures of a plan, recomputed from its pieces whenever a plan
    is built or read."""

    @property
    def makespan(self) -> float:
        """Modelled save time in seconds (docs/PLANNER.md, "Cost model")."""
    @property
    def lower_bound(self) -> float:
        """Proven lower bound on the makespan of any plan for the same inputs."""
    @property
    def gap(self) -> float:
        """``makespan / lower_bound``; 1.0 is optimal."""
    @property
    def pieces(self) -> int:
        """Pieces over all ranks."""
    @property
    def splits(self) -> int:
        """Extra pieces from cutting leaves: ``pieces - leaves``."""
    @property
    def writers(self) -> int:
        """Ranks that write anything."""
    @property
    def max_rank_bytes(self) -> int:
        """Bytes written by the most-loaded rank."""
    @property
    def plan_ms(self) -> float:
        """Wall time spent planning, in milliseconds."""
    @property
    def source(self) -> PlanSource:
        """Where the plan came from: "computed", "memory" or "disk" (the
        cache's tiers); through the planner service client "service",
        "service-cache" or "local-fallback"."""
    def to_dict(self) -> dict[str, float | int | str]:
        """The figures as a dict keyed by the property names."""

class _ModelledTime(TypedDict):
    """A modelled save time (``Plan.modelled_time``, ``model_time``)."""

    makespan: float
    rank_costs: list[float]
    rank_bytes: list[int]
    node_s: float
    aggregate_s: float
    writers: int
    pieces: int

@final
class Plan:
    """Which rank writes which pieces of which leaves, with its inputs and
    stats. Immutable; every plan, however it was made, has been validated."""

    def with_source(self, source: PlanSource) -> Plan:
        """The same plan with ``stats.source`` set to ``source``: how the
        planner service client says where a plan came from. Raises
        ``PlanError`` for an unknown source."""
    @property
    def world_size(self) -> int:
        """Ranks the plan is for."""
    @property
    def algorithm(self) -> Algorithm:
        """The algorithm that made it (or that a hand-built plan names)."""
    @property
    def fingerprint(self) -> str:
        """Hex blake3 hash of the inputs: manifest structure, world size,
        topology, cost model, algorithm and planner version."""
    def assignment_digest(self) -> str:
        """Hex blake3 hash of the assignment (world size and every rank's
        pieces), computed with the GIL released."""
    @property
    def manifest(self) -> Manifest:
        """The manifest the plan is for."""
    @property
    def cost(self) -> CostModel:
        """The cost model the plan was made and scored with."""
    @property
    def topology(self) -> Topology:
        """The topology the plan was made and scored with."""
    @property
    def stats(self) -> PlanStats:
        """Its quality figures."""
    def rank_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """The pieces of one rank as ``(leaf_index, start, stop)`` in flat
        element units (an object is ``(i, 0, 1)``), ordered by leaf then
        start. Raises ``PlanError`` for a rank outside the world."""
    def pieces(self, rank: int) -> list[tuple[tuple[PathKey, ...], int, int]]:
        """The pieces of one rank as ``(leaf_path, start, stop)``: ``start``
        and ``stop`` are flat element offsets into the leaf (elements, not
        bytes; an object is ``(path, 0, 1)``), ordered by leaf then start.
        Raises ``PlanError`` for a rank outside the world."""
    def rank_bytes(self) -> list[int]:
        """Bytes each rank writes."""
    def rank_costs(self) -> list[float]:
        """Modelled write time of each rank in seconds (``fixed_s`` plus its
        pieces; 0 for a rank that writes nothing)."""
    def modelled_time(
        self, cost: CostModel | None = None, topology: Topology | None = None
    ) -> _ModelledTime:
        """The planner's modelled time of this plan, from the one model that
        scores every plan (docs/PLANNER.md, "Cost model"), under ``cost``
        and ``topology`` (default: the plan's own, so that ``makespan`` is
        ``stats.makespan`` exactly). Raises ``PlanError`` for a topology that
        does not fit the world size."""
    def to_json(self) -> str:
        """The plan as JSON (inputs, fingerprint, pieces with their paths,
        stats), written with the GIL released."""
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
    ) -> Plan:
        """Rebuilds a plan from per-rank ``(leaf_index, start, stop)`` lists,
        e.g. as received from a planner service: the pieces are validated
        against the manifest and the stats recomputed, as for a new plan.
        Raises ``PlanError``."""
    @staticmethod
    def from_json(text: str) -> Plan:
        """Reads a plan written by ``to_json``, with the GIL released:
        validates its pieces against the embedded manifest, recomputes its
        stats and checks its fingerprint. Raises ``PlanError``."""

def plan(
    manifest: Manifest,
    world_size: int,
    *,
    algorithm: str = "balanced",
    cost: CostModel | None = None,
    topology: Topology | None = None,
    cache: PlanCache | None = None,
) -> Plan:
    """Computes a plan with the GIL released, deterministically: the same
    inputs give the same plan on every run and machine. With ``cache``, a
    plan for the same inputs is served from it, and a new one stored in it.
    Raises ``PlanError`` (invalid inputs; never because of the cache)."""

def model_time(
    cost: CostModel,
    rank_pieces: Sequence[int],
    rank_bytes: Sequence[int],
    *,
    topology: Topology | None = None,
) -> _ModelledTime:
    """The planner's modelled time of a save in which rank ``r`` writes
    ``rank_bytes[r]`` bytes in ``rank_pieces[r]`` pieces (a rank with no
    pieces does not write): the model that scores every plan, for
    assignments that are not DeepPart plans (torch.distributed.checkpoint's,
    for instance). Raises ``PlanError`` for lists of different lengths, an
    empty or too large world, or a topology that does not fit it."""

def plan_fingerprint(
    manifest: Manifest,
    world_size: int,
    *,
    algorithm: str = "balanced",
    cost: CostModel | None = None,
    topology: Topology | None = None,
) -> str:
    """The fingerprint a plan for these inputs would have, without planning.
    Raises ``PlanError`` for invalid inputs."""

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
    """A two-tier plan cache: a bounded in-process LRU in front of a SQLite
    store shared by all processes on the host. Faults (a damaged or
    unwritable store, an entry that fails its checks) are reported as
    ``CacheWarning`` and bypassed."""

    def __new__(
        cls,
        directory: str | PathLike[str] | None = None,
        *,
        memory_entries: int = 64,
        max_bytes: int = 536870912,
        disk: bool = True,
        planner_version: str | None = None,
    ) -> PlanCache:
        """``directory=None`` uses ``default_cache_dir()``; ``disk=False``
        keeps plans in memory only. ``memory_entries`` bounds the LRU,
        ``max_bytes`` the disk store. ``planner_version`` overrides the
        version stored with entries (for tests)."""
    @property
    def directory(self) -> str | None:
        """The cache directory, or None for a memory-only cache."""
    @property
    def path(self) -> str | None:
        """The SQLite database file, or None for a memory-only cache."""
    @property
    def memory_entries(self) -> int:
        """Most plans the in-process tier holds."""
    @property
    def max_bytes(self) -> int:
        """Most bytes the disk store holds before evicting."""
    def get(
        self,
        manifest: Manifest,
        world_size: int,
        *,
        algorithm: str = "balanced",
        cost: CostModel | None = None,
        topology: Topology | None = None,
    ) -> Plan | None:
        """Low-level: the cached plan for these inputs, or None; counts a hit
        or a miss. Raises ``PlanError`` for invalid inputs."""
    def put(self, plan: Plan) -> bool:
        """Low-level: stores a plan in both tiers; returns whether the disk
        store took it."""
    def stats(self) -> _CacheStats:
        """Counters of this cache object (hits, misses, evictions, discarded
        and stale entries), the sizes of both tiers and the disk store's state."""
    def clear(self) -> int:
        """Empties both tiers (a damaged database is recreated); returns the
        number of disk entries removed. Raises ``CacheError`` if the store
        cannot be opened or written."""
    def verify(self) -> _VerifyReport:
        """Checks the database and every entry, deleting entries that fail.
        Raises ``CacheError`` if the database cannot be read or fails
        SQLite's integrity check."""

def default_cache_dir() -> str | None:
    """The default plan cache directory: $DEEPPART_CACHE_DIR, else
    $XDG_CACHE_HOME/deeppart, else ~/.cache/deeppart (None without a home)."""

# Reed-Solomon erasure coding (deeppart_planner::erasure). Shards are any
# C-contiguous buffers, read as raw bytes. Parity shards have the longest
# data length rounded up to even; reconstruction needs the data lengths.
# (numpy's stubs declare ndarray a Buffer only for Python >= 3.12: under
# 3.11, pass array.data, a memoryview without a copy.)
def rs_encode(shards: Iterable[Buffer], parity: int) -> list[bytes]:
    """``parity`` parity shards of the data ``shards``, encoded with the GIL
    released. Raises ``ErasureError`` for an unsupported shard count."""

def rs_reconstruct(
    original_count: int,
    parity_count: int,
    originals: Mapping[int, Buffer],
    parity: Mapping[int, Buffer],
    lengths: Sequence[int],
) -> list[bytes]:
    """All ``original_count`` data shards, restored from the surviving
    ``originals`` and ``parity`` shards (by index) and the data lengths.
    Raises ``ErasureError`` when too few survive or they disagree in size."""

# Replica digests (deeppart_planner::replica): 16-byte BLAKE3 digests of
# leaf buffers, hashed with the GIL released, and the leaves on which ranks'
# digests differ, with the ranks that differ from the majority.
def replica_digests(buffers: Iterable[Buffer], threads: int = 1) -> bytes:
    """The ``REPLICA_DIGEST_LEN``-byte digests of ``buffers``, concatenated,
    hashed on at most ``threads`` threads with the GIL released."""

def differing_leaves(per_rank: Sequence[bytes], leaves: int) -> list[tuple[int, list[int]]]:
    """The leaves on which the ranks' concatenated digests differ, each with
    the ranks that differ from the majority."""

# Streaming copies (deeppart_planner::copy): an asynchronous save's snapshot.
def copy_into(dst: Buffer, src: Buffer) -> None:
    """Copies ``src`` into ``dst`` (C-contiguous buffers of one length,
    ``dst`` writable, not overlapping), with non-temporal stores from
    ``STREAMING_MIN_BYTES`` on (x86_64), the GIL released. Raises TypeError
    for a read-only or non-buffer ``dst``, ValueError for lengths that
    differ, a non-contiguous buffer or overlapping buffers."""

# Writing a piece and checksumming it in one pass (deeppart_planner::filewrite):
# an asynchronous save's writer.
def write_hashed(fd: int, offset: int, data: Buffer, chunk: int, pace: bool) -> int:
    """Writes ``data`` (a C-contiguous buffer) into the open file descriptor
    ``fd`` at ``offset``, ``chunk`` bytes per write call, and returns its
    xxh3_64; with ``pace``, each chunk's write-back to the device is started
    at once and waited for one chunk behind (``sync_file_range``, Linux).
    The GIL is released throughout; an I/O error raises OSError; ``fd``
    stays open."""

def xxh3_64(data: Buffer) -> int:
    """xxh3_64 of ``data`` (a C-contiguous buffer), the GIL released."""
