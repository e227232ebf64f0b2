from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlanStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_STATUS_UNSPECIFIED: _ClassVar[PlanStatus]
    PLAN_STATUS_OK: _ClassVar[PlanStatus]
    PLAN_STATUS_NEED_MANIFEST: _ClassVar[PlanStatus]
PLAN_STATUS_UNSPECIFIED: PlanStatus
PLAN_STATUS_OK: PlanStatus
PLAN_STATUS_NEED_MANIFEST: PlanStatus

class Manifest(_message.Message):
    __slots__ = ("version", "string_keys", "int_keys", "shared", "suffix_len", "suffix_keys", "dtypes", "dtype", "ndim", "dims", "object_nbytes", "owned_leaves", "owner_ranks", "group_sizes", "group_ranks", "holders")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STRING_KEYS_FIELD_NUMBER: _ClassVar[int]
    INT_KEYS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NDIM_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    OBJECT_NBYTES_FIELD_NUMBER: _ClassVar[int]
    OWNED_LEAVES_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANKS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    string_keys: _containers.RepeatedScalarFieldContainer[str]
    int_keys: _containers.RepeatedScalarFieldContainer[int]
    shared: _containers.RepeatedScalarFieldContainer[int]
    suffix_len: _containers.RepeatedScalarFieldContainer[int]
    suffix_keys: _containers.RepeatedScalarFieldContainer[int]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    dtype: _containers.RepeatedScalarFieldContainer[int]
    ndim: _containers.RepeatedScalarFieldContainer[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    object_nbytes: _containers.RepeatedScalarFieldContainer[int]
    owned_leaves: _containers.RepeatedScalarFieldContainer[int]
    owner_ranks: _containers.RepeatedScalarFieldContainer[int]
    group_sizes: _containers.RepeatedScalarFieldContainer[int]
    group_ranks: _containers.RepeatedScalarFieldContainer[int]
    holders: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., string_keys: _Optional[_Iterable[str]] = ..., int_keys: _Optional[_Iterable[int]] = ..., shared: _Optional[_Iterable[int]] = ..., suffix_len: _Optional[_Iterable[int]] = ..., suffix_keys: _Optional[_Iterable[int]] = ..., dtypes: _Optional[_Iterable[str]] = ..., dtype: _Optional[_Iterable[int]] = ..., ndim: _Optional[_Iterable[int]] = ..., dims: _Optional[_Iterable[int]] = ..., object_nbytes: _Optional[_Iterable[int]] = ..., owned_leaves: _Optional[_Iterable[int]] = ..., owner_ranks: _Optional[_Iterable[int]] = ..., group_sizes: _Optional[_Iterable[int]] = ..., group_ranks: _Optional[_Iterable[int]] = ..., holders: _Optional[_Iterable[int]] = ...) -> None: ...

class CostModel(_message.Message):
    __slots__ = ("fixed_s", "piece_s", "bandwidth", "writer_s", "min_piece_bytes", "align_bytes", "grain", "node_bandwidth", "aggregate_bandwidth")
    FIXED_S_FIELD_NUMBER: _ClassVar[int]
    PIECE_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    WRITER_S_FIELD_NUMBER: _ClassVar[int]
    MIN_PIECE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALIGN_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRAIN_FIELD_NUMBER: _ClassVar[int]
    NODE_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    fixed_s: float
    piece_s: float
    bandwidth: float
    writer_s: float
    min_piece_bytes: int
    align_bytes: int
    grain: str
    node_bandwidth: float
    aggregate_bandwidth: float
    def __init__(self, fixed_s: _Optional[float] = ..., piece_s: _Optional[float] = ..., bandwidth: _Optional[float] = ..., writer_s: _Optional[float] = ..., min_piece_bytes: _Optional[int] = ..., align_bytes: _Optional[int] = ..., grain: _Optional[str] = ..., node_bandwidth: _Optional[float] = ..., aggregate_bandwidth: _Optional[float] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("ranks_per_node",)
    RANKS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    ranks_per_node: int
    def __init__(self, ranks_per_node: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("plan_fingerprint", "manifest_fingerprint", "world_size", "algorithm", "cost", "topology", "manifest", "job_id", "planner_version")
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PLANNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    plan_fingerprint: str
    manifest_fingerprint: str
    world_size: int
    algorithm: str
    cost: CostModel
    topology: Topology
    manifest: Manifest
    job_id: str
    planner_version: str
    def __init__(self, plan_fingerprint: _Optional[str] = ..., manifest_fingerprint: _Optional[str] = ..., world_size: _Optional[int] = ..., algorithm: _Optional[str] = ..., cost: _Optional[_Union[CostModel, _Mapping]] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., job_id: _Optional[str] = ..., planner_version: _Optional[str] = ...) -> None: ...

class Pieces(_message.Message):
    __slots__ = ("rank_counts", "leaf_deltas", "starts", "stops")
    RANK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LEAF_DELTAS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    STOPS_FIELD_NUMBER: _ClassVar[int]
    rank_counts: _containers.RepeatedScalarFieldContainer[int]
    leaf_deltas: _containers.RepeatedScalarFieldContainer[int]
    starts: _containers.RepeatedScalarFieldContainer[int]
    stops: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank_counts: _Optional[_Iterable[int]] = ..., leaf_deltas: _Optional[_Iterable[int]] = ..., starts: _Optional[_Iterable[int]] = ..., stops: _Optional[_Iterable[int]] = ...) -> None: ...

class PlanStats(_message.Message):
    __slots__ = ("makespan", "lower_bound", "gap", "pieces", "splits", "writers", "max_rank_bytes", "plan_ms", "source")
    MAKESPAN_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    WRITERS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    makespan: float
    lower_bound: float
    gap: float
    pieces: int
    splits: int
    writers: int
    max_rank_bytes: int
    plan_ms: float
    source: str
    def __init__(self, makespan: _Optional[float] = ..., lower_bound: _Optional[float] = ..., gap: _Optional[float] = ..., pieces: _Optional[int] = ..., splits: _Optional[int] = ..., writers: _Optional[int] = ..., max_rank_bytes: _Optional[int] = ..., plan_ms: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("status", "plan_fingerprint", "manifest_fingerprint", "world_size", "algorithm", "pieces", "stats", "planner_version", "served_from", "cost", "topology")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PLANNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_FROM_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    status: PlanStatus
    plan_fingerprint: str
    manifest_fingerprint: str
    world_size: int
    algorithm: str
    pieces: Pieces
    stats: PlanStats
    planner_version: str
    served_from: str
    cost: CostModel
    topology: Topology
    def __init__(self, status: _Optional[_Union[PlanStatus, str]] = ..., plan_fingerprint: _Optional[str] = ..., manifest_fingerprint: _Optional[str] = ..., world_size: _Optional[int] = ..., algorithm: _Optional[str] = ..., pieces: _Optional[_Union[Pieces, _Mapping]] = ..., stats: _Optional[_Union[PlanStats, _Mapping]] = ..., planner_version: _Optional[str] = ..., served_from: _Optional[str] = ..., cost: _Optional[_Union[CostModel, _Mapping]] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("plan_fingerprint", "job_id")
    PLAN_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    plan_fingerprint: str
    job_id: str
    def __init__(self, plan_fingerprint: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobStats(_message.Message):
    __slots__ = ("job_id", "requests", "errors", "mean_ms", "p50_ms", "p99_ms", "max_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    requests: int
    errors: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    def __init__(self, job_id: _Optional[str] = ..., requests: _Optional[int] = ..., errors: _Optional[int] = ..., mean_ms: _Optional[float] = ..., p50_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ..., max_ms: _Optional[float] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("planner_version", "uptime_s", "requests", "plan_requests", "manifest_uploads", "need_manifest", "plans_computed", "response_cache_hits", "plan_cache_hits", "known_manifests", "response_cache_bytes", "in_flight", "errors_by_code", "jobs", "rss_bytes", "serving")
    class ErrorsByCodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PLANNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_UPLOADS_FIELD_NUMBER: _ClassVar[int]
    NEED_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PLANS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PLAN_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ERRORS_BY_CODE_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    planner_version: str
    uptime_s: float
    requests: int
    plan_requests: int
    manifest_uploads: int
    need_manifest: int
    plans_computed: int
    response_cache_hits: int
    plan_cache_hits: int
    known_manifests: int
    response_cache_bytes: int
    in_flight: int
    errors_by_code: _containers.ScalarMap[str, int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStats]
    rss_bytes: int
    serving: bool
    def __init__(self, planner_version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., requests: _Optional[int] = ..., plan_requests: _Optional[int] = ..., manifest_uploads: _Optional[int] = ..., need_manifest: _Optional[int] = ..., plans_computed: _Optional[int] = ..., response_cache_hits: _Optional[int] = ..., plan_cache_hits: _Optional[int] = ..., known_manifests: _Optional[int] = ..., response_cache_bytes: _Optional[int] = ..., in_flight: _Optional[int] = ..., errors_by_code: _Optional[_Mapping[str, int]] = ..., jobs: _Optional[_Iterable[_Union[JobStats, _Mapping]]] = ..., rss_bytes: _Optional[int] = ..., serving: _Optional[bool] = ...) -> None: ...
