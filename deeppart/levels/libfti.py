"""Finding and loading libfti (github leobago/fti, v1.5/1.6) with ctypes:
the one module that knows the shared library (docs/FTI.md).

:func:`find_libfti` locates it (``FTI_LIBRARY``, else the linker's search
path through :func:`ctypes.util.find_library`); :func:`load_libfti` loads
it after mpi4py (which maps its MPI library first), checks that it has the
FTI >= 1.5 API and that it uses mpi4py's MPI library
(:func:`check_same_mpi`), and declares the C signatures of the functions
the backend calls. FTI's return codes are here too.

:class:`deeppart.levels.fti.FTIBackend` calls :func:`load_libfti` when it
is created, before ``FTI_Init``; everything else about FTI (its config
file, protecting, checkpointing and recovering the pieces) is in
:mod:`deeppart.levels.fti`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from typing import Any

from deeppart.errors import FTIError

__all__ = [
    "FTI_DONE",
    "FTI_NREC",
    "FTI_NSCS",
    "FTI_SCES",
    "Lib",
    "check_same_mpi",
    "find_libfti",
    "load_libfti",
]

#: FTI's return codes (include/fti.h).
FTI_SCES, FTI_NSCS, FTI_NREC, FTI_DONE = 0, -1, -2, 1


def find_libfti() -> str | None:
    """The libfti to load: ``$FTI_LIBRARY`` when set (a path, not checked
    here), else what ``ctypes.util.find_library("fti")`` finds, else None."""
    env = os.environ.get("FTI_LIBRARY", "").strip()
    if env:
        return env
    return ctypes.util.find_library("fti")


def _mapped_mpi_libraries() -> set[str]:
    """Real paths of the MPI libraries mapped into this process (Linux)."""
    found: set[str] = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                name = os.path.basename(path)
                if name.startswith(("libmpi.so", "libmpich.so", "libmpi_mpifh", "libmpi_abi")):
                    found.add(os.path.realpath(path))
    except OSError:
        pass
    return found


def check_same_mpi(before: set[str], after: set[str], library: str) -> None:
    """Raises :class:`FTIError` when loading ``library`` mapped an MPI
    library that mpi4py had not (``before``/``after``: the mapped MPI
    libraries around the load, from ``/proc/self/maps``)."""
    new = sorted(after - before)
    if new and before:
        raise FTIError(
            f"{library} is linked against another MPI library than mpi4py: it loaded "
            f"{', '.join(new)}, mpi4py uses {', '.join(sorted(before))}. Rebuild FTI with "
            "the MPI compiler wrappers of the MPI that mpi4py uses (docs/FTI.md)"
        )


@dataclass
class Lib:
    """libfti's functions, with their C signatures."""

    cdll: ctypes.CDLL
    path: str
    comm_type: Any
    mpi_libraries: list[str]

    def comm_world(self) -> int:
        """FTI's global ``FTI_COMM_WORLD`` handle (valid after FTI_Init)."""
        value = int(self.comm_type.in_dll(self.cdll, "FTI_COMM_WORLD").value or 0)
        if self.comm_type is ctypes.c_int:
            value &= 0xFFFFFFFF  # MPICH's handles are unsigned to mpi4py (0x84000000...)
        return value

    def char_type(self) -> int:
        """FTI's ``FTI_CHAR`` type id (valid after FTI_Init)."""
        return int(ctypes.c_int.in_dll(self.cdll, "FTI_CHAR").value)


_FUNCTIONS: dict[str, tuple[Any, list[Any]]] = {
    # name: (restype, argtypes); FTI_Init's communicator type is set per MPI.
    "FTI_Init": (ctypes.c_int, [ctypes.c_char_p]),
    "FTI_Status": (ctypes.c_int, []),
    "FTI_Protect": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]),
    "FTI_Checkpoint": (ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    "FTI_Recover": (ctypes.c_int, []),
    "FTI_GetStoredSize": (ctypes.c_int64, [ctypes.c_int]),
    "FTI_Finalize": (ctypes.c_int, []),
}


def _mpi_comm_type() -> Any:
    """The ctypes type of an ``MPI_Comm`` handle: a pointer (Open MPI) or an
    int (MPICH and its derivatives)."""
    from mpi4py import MPI

    return ctypes.c_void_p if MPI._sizeof(MPI.Comm) == 8 else ctypes.c_int


def load_libfti(library: str | None = None) -> Lib:
    """Loads libfti (``library``, else :func:`find_libfti`) after mpi4py,
    checks it has the FTI >= 1.5 API and uses mpi4py's MPI library."""
    path = library if library is not None else find_libfti()
    if not path:
        raise FTIError(
            "libfti was not found: set FTI_LIBRARY to the path of libfti.so, or install it "
            "where the dynamic linker finds it (see docs/FTI.md)"
        )
    if os.sep in path and not os.path.isfile(path):
        raise FTIError(f"libfti {path!r} (FTI_LIBRARY or library=): no such file")
    from mpi4py import MPI  # noqa: F401  (initialises MPI, maps its library first)

    before = _mapped_mpi_libraries()
    try:
        cdll = ctypes.CDLL(path)
    except OSError as e:
        raise FTIError(f"cannot load libfti from {path!r}: {e}") from e
    missing = [
        name for name in (*_FUNCTIONS, "FTI_COMM_WORLD", "FTI_CHAR") if not hasattr(cdll, name)
    ]
    if missing:
        raise FTIError(f"{path} is not an FTI library (missing {', '.join(missing)})")
    if not hasattr(cdll, "FTI_InitType_opaque"):
        raise FTIError(
            f"{path}: FTI older than 1.5 (its FTI_Protect takes a struct type, not an "
            "fti_id_t); DeepPart needs FTI 1.5 or 1.6"
        )
    after = _mapped_mpi_libraries()
    check_same_mpi(before, after, path)
    comm_type = _mpi_comm_type()
    for name, (restype, argtypes) in _FUNCTIONS.items():
        fn = getattr(cdll, name)
        fn.restype = restype
        fn.argtypes = [*argtypes, comm_type] if name == "FTI_Init" else argtypes
    return Lib(cdll, path, comm_type, sorted(after))
