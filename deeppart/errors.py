"""Every exception and warning DeepPart raises, and the table that carries
an exception's type from the rank that failed to all the others.

All exceptions derive from :class:`DeepPartError` (defined by the Rust
core, so that the planner's own errors share it). Some also derive from the
built-in class that they refined before they had a common base
(``StateError`` is a ``TypeError``, ``CodecError`` a ``ValueError``, ...),
so ``except TypeError`` keeps working where it worked.

The hierarchy::

    DeepPartError
    ├── ManifestError, PlanError, CacheError, ErasureError   (Rust core)
    ├── StateError (TypeError)            a state holds what cannot be saved
    │   └── ValueEncodeError              a supported type with a bad value
    ├── CodecError (ValueError)           unknown codec, undecodable data
    ├── CheckpointError                   a checkpoint cannot be saved/loaded
    │   ├── CorruptCheckpointError        files do not match their metadata
    │   ├── NoSpaceError (OSError)        the device is full (ENOSPC, EDQUOT)
    │   ├── StateMismatchError            ranks or ``into=`` disagree
    │   │   └── ReplicaMismatchError      replicas differ (verify_replicas)
    │   ├── LevelConfigError              a multi-level config is wrong
    │   ├── TopologyMismatchError         L1-L3 written by another layout
    │   ├── UnrecoverableError            more lost than the levels repair
    │   ├── StoreConfigError (ValueError) a store that cannot be used
    │   ├── FTIError                      libfti missing or a call failed
    │   └── ExportError                   export/import of other formats
    ├── DcpPlanError (RuntimeError)       torch.distributed.checkpoint planner
    ├── PlannerServiceError               the planner service refused/failed
    ├── ServiceUnavailable (RuntimeError) no usable plan, and no fallback
    ├── WireError (ValueError)            a malformed service message
    └── ServiceError                      (server side) ends an RPC with a code
"""

from __future__ import annotations

from typing import Any

from deeppart._planner import (
    CacheError,
    CacheWarning,
    DeepPartError,
    ErasureError,
    ManifestError,
    PlanError,
)

__all__ = [
    "ERROR_TYPES",
    "AsyncSaveWarning",
    "CacheError",
    "CacheWarning",
    "CheckpointError",
    "CodecError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "DcpPlanError",
    "DeepPartError",
    "ErasureError",
    "ExportError",
    "FTIError",
    "ForeignPathError",
    "LevelConfigError",
    "ManifestError",
    "NoSpaceError",
    "NotInPlaceWarning",
    "ObjectExistsError",
    "OlderStepWarning",
    "PerRankStateError",
    "PlanError",
    "PlannerServiceError",
    "ReplicaMismatchError",
    "RngStateWarning",
    "ServiceError",
    "ServiceUnavailable",
    "StateError",
    "StateMismatchError",
    "StoreConfigError",
    "TopologyMismatchError",
    "UnrecoverableError",
    "UnsupportedURLError",
    "ValueEncodeError",
    "WireError",
    "code_of",
    "type_of_code",
]


# ----------------------------------------------------------------------------
# State and encoding.


class StateError(DeepPartError, TypeError):
    """A state tree holds something DeepPart cannot save safely."""


class ValueEncodeError(StateError):
    """A value of a supported type that cannot be stored (e.g. an object array)."""


class CodecError(DeepPartError, ValueError):
    """Unknown codec, or data that does not decode."""


# ----------------------------------------------------------------------------
# Checkpoints.


class CheckpointError(DeepPartError):
    """A checkpoint cannot be saved or loaded."""


class ForeignPathError(CheckpointError):
    """A save's target holds something DeepPart did not write (a regular
    file, a symbolic link, a directory with other files): DeepPart replaces
    and removes only its own checkpoints (:mod:`deeppart.storage.ownership`)."""


class CommitConflictError(CheckpointError):
    """A save's commit found its target taken: another save committed there
    first (with ``overwrite=False``), or something that is not a committed
    DeepPart checkpoint appeared at the target while the save was writing.
    Nothing at the target was replaced; the save's own files are removed."""


class UnsupportedURLError(CheckpointError, ValueError):
    """A path is a URL (``scheme://...``) that DeepPart does not serve: it
    reads and writes local (or mounted) file systems only."""


class StoreConfigError(CheckpointError, ValueError):
    """A store cannot be used as configured: the AWS shared config or
    credentials file is malformed, names a profile it does not have, or
    gets credentials in a way DeepPart does not run
    (:mod:`deeppart.storage.aws_profile`); the bucket does not exist, the
    endpoint cannot be reached or refuses the credentials
    (:meth:`deeppart.storage.s3.S3Store.config_error`); or the ranks of a
    save do not address one store (another endpoint, a directory that is
    not shared), found before anything is written or before the commit
    (:mod:`deeppart.storage.identity`)."""


class ObjectExistsError(CheckpointError, FileExistsError):
    """A store refused a conditional put (:mod:`deeppart.storage`): the
    object exists (``create=True``) or is no longer the version named by
    ``if_match``. A save's commit turns it into :class:`CommitConflictError`."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its metadata (bad checksum,
    truncated file, malformed metadata)."""


class NoSpaceError(CheckpointError, OSError):
    """A save ran out of space (``ENOSPC``, or ``EDQUOT``: a quota) on the
    device it writes to: nothing was committed, the save's own files were
    removed, and the checkpoints committed before stay as they are. Also an
    :class:`OSError`, as the error it replaces was."""


class StateMismatchError(CheckpointError):
    """Ranks disagree on the state's structure or the plan, or the state to
    load into does not match the checkpoint."""


class ReplicaMismatchError(StateMismatchError):
    """The ranks' copies of the replicated state differ (``verify_replicas``)."""


class PerRankStateError(StateMismatchError):
    """A checkpoint holds per-rank values or distinct versions of one path
    (one per group of saved ranks) that this load cannot give each rank its
    own of (another world size, one process): pass ``per_rank=``."""


class LevelConfigError(CheckpointError):
    """A multi-level config is malformed or does not fit the job."""


class TopologyMismatchError(CheckpointError):
    """A node-local (L1-L3) checkpoint was written by another world size or
    node layout and cannot be restored there. The built-in level engine no
    longer raises it: it recovers such a step from what the survivors hold,
    resharded, or raises :class:`UnrecoverableError` naming the old ranks
    and the levels tried."""


class UnrecoverableError(CheckpointError):
    """More was lost than the checkpoint's levels can repair."""


class FTIError(CheckpointError):
    """libfti is missing, unusable, or an FTI call failed."""


class ExportError(CheckpointError):
    """A checkpoint cannot be exported, or a file cannot be imported."""


class DcpPlanError(DeepPartError, RuntimeError):
    """The ranks' replicated states differ, or a plan does not fit the state
    (``deeppart.integrations.dcp``, the torch.distributed.checkpoint planners)."""


# ----------------------------------------------------------------------------
# The planner service.


class PlannerServiceError(DeepPartError):
    """The planner service refused or failed a request in a way that
    planning in process would hide: a wrong or missing token, no permission,
    another planner version, a target that is not a DeepPart service, or a
    plan that does not check out. (An unreachable service is planned around.)"""


class ServiceUnavailable(DeepPartError, RuntimeError):
    """The service could not give a usable plan (with ``fallback=False``)."""


class WireError(DeepPartError, ValueError):
    """A service message is inconsistent or names something that does not exist."""


class ServiceError(DeepPartError):
    """Server side: ends an RPC with a gRPC status code (``code``, a
    ``grpc.StatusCode``) and a message naming the problem."""

    def __init__(self, code: Any, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# ----------------------------------------------------------------------------
# Warnings.


class AsyncSaveWarning(UserWarning):
    """An asynchronous save that ran synchronously (the reason is in the message)."""


class NotInPlaceWarning(UserWarning):
    """``load(into=...)`` could not set some plain values in the caller's
    state in place (they sit in a tuple, or at the root): the returned
    state holds them."""


class OlderStepWarning(UserWarning):
    """A multi-level restore without a step loaded an older step than the
    newest committed one, which could not be recovered here (the message
    names each skipped step and why: a node's files lost, or a copy that
    failed verification, at this or another world size)."""


class RngStateWarning(UserWarning):
    """A checkpoint's RNG states could not be restored on this rank."""


# ----------------------------------------------------------------------------
# Carrying an error's type to the other ranks.

#: Every DeepPart exception that can fail a collective step, most derived
#: first, so that :func:`code_of` finds an error's own class. Its position
#: (plus one) is the code that the agreement collective sends; code 0 means
#: no error. A new class goes before its bases (codes travel only between
#: the ranks of one job, which run the same code).
ERROR_TYPES: tuple[type[DeepPartError], ...] = (
    ReplicaMismatchError,
    PerRankStateError,
    CorruptCheckpointError,
    StateMismatchError,
    LevelConfigError,
    TopologyMismatchError,
    UnrecoverableError,
    FTIError,
    ExportError,
    ForeignPathError,
    CommitConflictError,
    UnsupportedURLError,
    ObjectExistsError,
    StoreConfigError,
    NoSpaceError,
    CheckpointError,
    ValueEncodeError,
    StateError,
    CodecError,
    DcpPlanError,
    ServiceUnavailable,
    PlannerServiceError,
    WireError,
    ManifestError,
    PlanError,
    CacheError,
    ErasureError,
    DeepPartError,
)


def code_of(err: BaseException) -> int:
    """The code of ``err``'s type in :data:`ERROR_TYPES` (1-based); for an
    exception that is not DeepPart's, the code of :class:`CheckpointError`,
    as which the other ranks then see it. The table lists subclasses before
    their bases, so the first match is ``err``'s own class (or its nearest
    listed base)."""
    for i, cls in enumerate(ERROR_TYPES):
        if isinstance(err, cls):
            return i + 1
    return ERROR_TYPES.index(CheckpointError) + 1


def type_of_code(code: int) -> type[DeepPartError]:
    """The exception type a code from :func:`code_of` stands for
    (:class:`CheckpointError` for a code out of range)."""
    if 1 <= code <= len(ERROR_TYPES):
        return ERROR_TYPES[code - 1]
    return CheckpointError
