"""The plan cache: memory and disk tiers, shared by processes, surviving
restarts, SIGKILL and damage; never failing planning, never serving a wrong plan."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

import deeppart
from deeppart import CacheError, CacheWarning, PlanCache
from deeppart.tools.cli import main as cli_main

TESTS = Path(__file__).resolve().parent
WORLD = 16


def make_manifest(key: int, n: int = 600) -> deeppart.Manifest:
    """A deterministic manifest per ``key``: tensors of varied shapes, a few
    objects and owned leaves (so plans have splits, owners and objects)."""
    rng = random.Random(key)
    leaves: list[dict[str, Any]] = []
    for i in range(n):
        path = ["k", key, "layer", i]
        r = rng.random()
        if r < 0.05:
            leaves.append({"path": path, "kind": "object", "nbytes": rng.randint(1, 5000)})
        elif r < 0.08:
            leaves.append(
                {"path": path, "dtype": "uint8", "shape": [rng.randint(1, 999)], "owner": i % WORLD}
            )
        else:
            shape = [rng.randint(1, 4096), rng.choice([1, 64, 768])]
            leaves.append(
                {"path": path, "dtype": rng.choice(["float32", "bfloat16"]), "shape": shape}
            )
    return deeppart.Manifest.from_leaves(leaves)


def digest(plan: deeppart.Plan) -> str:
    """A hash of every rank's pieces."""
    pieces = [plan.rank_pieces(r) for r in range(plan.world_size)]
    return hashlib.sha256(json.dumps(pieces).encode()).hexdigest()


def run_child(code: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        **kw,
    )


CHILD_PRELUDE = f"""
import json, sys, warnings
sys.path.insert(0, {str(TESTS)!r})
import deeppart
from test_cache import make_manifest, digest, WORLD
"""


def test_sources_are_computed_memory_then_disk(tmp_path: Path) -> None:
    m = make_manifest(1)
    cache = PlanCache(tmp_path)
    a = deeppart.plan(m, WORLD, cache=cache)
    b = deeppart.plan(m, WORLD, cache=cache)
    c = deeppart.plan(m, WORLD, cache=PlanCache(tmp_path))
    assert [p.stats.source for p in (a, b, c)] == ["computed", "memory", "disk"]
    assert a.fingerprint == b.fingerprint == c.fingerprint
    assert digest(a) == digest(b) == digest(c)
    assert a.stats.makespan == c.stats.makespan and a.stats.gap == c.stats.gap
    s = cache.stats()
    assert (s["hits_memory"], s["misses"], s["entries"]) == (1, 1, 1)
    assert s["bytes"] > 0 and s["disk"] == "ok"
    assert cache.path == str(tmp_path / "plans-v1.sqlite")
    # The low-level get/put.
    assert cache.get(m, WORLD) is not None
    assert cache.get(m, WORLD + 1) is None
    other = PlanCache(tmp_path / "other")
    assert other.put(a) is True
    got = PlanCache(tmp_path / "other").get(m, WORLD)
    assert got is not None and got.stats.source == "disk" and digest(got) == digest(a)


def test_a_plan_computed_in_one_process_is_served_from_disk_in_a_new_one(tmp_path: Path) -> None:
    code = CHILD_PRELUDE + textwrap.dedent("""
    p = deeppart.plan(make_manifest(2), WORLD, cache=deeppart.PlanCache(sys.argv[1]))
    print(json.dumps({"source": p.stats.source, "fingerprint": p.fingerprint, "digest": digest(p)}))
    """)
    first = json.loads(run_child(code, str(tmp_path)).stdout)
    second = json.loads(run_child(code, str(tmp_path)).stdout)
    assert (first["source"], second["source"]) == ("computed", "disk")
    reference = deeppart.plan(make_manifest(2), WORLD, cache=False)
    assert reference.stats.source == "computed"
    for r in (first, second):
        assert r["fingerprint"] == reference.fingerprint
        assert r["digest"] == digest(reference)


def test_eight_processes_share_the_cache_without_errors_or_torn_entries(tmp_path: Path) -> None:
    shared = [100 + k for k in range(4)]
    code = CHILD_PRELUDE + textwrap.dedent("""
    import os, time
    directory, me, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    keys = [100, 101, 102, 103, 200 + 2 * me, 201 + 2 * me]
    manifests = {k: make_manifest(k, 400) for k in keys}
    while not os.path.exists(go):
        time.sleep(0.005)
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = deeppart.PlanCache(directory, memory_entries=0)  # every hit reads the disk
        for round in range(4):
            for k in keys[me % 6:] + keys[:me % 6]:
                p = deeppart.plan(manifests[k], WORLD, cache=cache)
                out.append([k, p.stats.source, p.fingerprint, digest(p)])
    print(json.dumps({"results": out, "warnings": [str(w.message) for w in caught]}))
    """)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "c"), str(i), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    go.touch()
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        outputs.append(json.loads(out))
    keys = {k for o in outputs for k, *_ in o["results"]}
    reference = {}
    for k in keys:
        ref = deeppart.plan(make_manifest(k, 400), WORLD, cache=False)
        reference[k] = (ref.fingerprint, digest(ref))
    sources: dict[str, int] = {}
    for o in outputs:
        assert o["warnings"] == []
        for k, source, fp, dig in o["results"]:
            assert (fp, dig) == reference[k]
            sources[source] = sources.get(source, 0) + 1
    assert sources.get("disk", 0) > 0
    assert "memory" not in sources
    check = PlanCache(tmp_path / "c")
    assert check.verify() == {
        "entries": len(keys),
        "valid": len(keys),
        "discarded": 0,
        "other_version": 0,
    }
    assert set(shared) <= keys


KILL_CHILD = (
    CHILD_PRELUDE
    + """
directory, count = sys.argv[1], int(sys.argv[2])
manifests = [make_manifest(300 + i, 300 + 150 * i) for i in range(count)]
plans = [deeppart.plan(m, WORLD, cache=False) for m in manifests]
cache = deeppart.PlanCache(directory, memory_entries=0)
print("ready", flush=True)
i = 0
while True:  # writes until killed
    ok = cache.put(plans[i % count])
    print(i % count, int(ok), flush=True)
    i += 1
"""
)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_during_writes_leaves_every_committed_plan_servable(
    tmp_path: Path, seed: int
) -> None:
    count = 8
    rng = random.Random(seed)
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILL_CHILD), str(tmp_path), str(count)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
    committed: set[int] = set()
    lines = 0
    # Every plan committed at least once, then a kill at a random write.
    target = count + rng.randint(0, 3 * count)
    while len(committed) < count or lines < target:
        line = proc.stdout.readline()
        assert line, "the writer died early"
        index, ok = map(int, line.split())
        assert ok == 1
        committed.add(index)
        lines += 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = PlanCache(tmp_path)
        assert cache.verify()["discarded"] == 0
        for i in sorted(committed):
            m = make_manifest(300 + i, 300 + 150 * i)
            got = cache.get(m, WORLD)
            assert got is not None, f"committed plan {i} is missing"
            assert got.stats.source == "disk"
            ref = deeppart.plan(m, WORLD, cache=False)
            assert (got.fingerprint, digest(got)) == (ref.fingerprint, digest(ref))
        # And the cache still takes writes.
        assert deeppart.plan(make_manifest(999), WORLD, cache=cache).stats.source == "computed"
        assert PlanCache(tmp_path).get(make_manifest(999), WORLD) is not None
    assert [str(w.message) for w in caught] == []


def _fill(directory: Path, keys: range) -> dict[int, deeppart.Plan]:
    cache = PlanCache(directory)
    plans = {k: deeppart.plan(make_manifest(k, 1500), WORLD, cache=cache) for k in keys}
    del cache  # closes the database: the WAL is checkpointed into the file
    return plans


def _expect_fallback(directory: Path, plans: dict[int, deeppart.Plan]) -> None:
    """Every plan is recomputed (correctly) with exactly one warning, and the
    cache works again afterwards."""
    cache = PlanCache(directory)
    with pytest.warns(CacheWarning) as record:
        for k, ref in plans.items():
            got = deeppart.plan(make_manifest(k, 1500), WORLD, cache=cache)
            assert got.stats.source in ("computed", "memory")
            assert (got.fingerprint, digest(got)) == (ref.fingerprint, digest(ref))
    assert len(record) == 1, [str(w.message) for w in record]
    again = PlanCache(directory)
    k, ref = next(iter(plans.items()))
    got = deeppart.plan(make_manifest(k, 1500), WORLD, cache=again)
    assert got.stats.source == "disk" and digest(got) == digest(ref)


def test_a_truncated_cache_file_falls_back_to_planning_with_a_warning(tmp_path: Path) -> None:
    plans = _fill(tmp_path, range(10, 14))
    db = tmp_path / "plans-v1.sqlite"
    assert not (tmp_path / "plans-v1.sqlite-wal").exists()
    size = db.stat().st_size
    with db.open("r+b") as f:
        f.truncate(size // 3)
    _expect_fallback(tmp_path, plans)


@pytest.mark.parametrize("where", ["whole", "after-header", "entry"])
def test_garbage_in_the_cache_file_falls_back_to_planning_with_a_warning(
    tmp_path: Path, where: str
) -> None:
    plans = _fill(tmp_path, range(20, 23))
    db = tmp_path / "plans-v1.sqlite"
    data = bytearray(db.read_bytes())
    rng = random.Random(7)
    if where == "whole":
        data[:] = bytes(rng.getrandbits(8) for _ in range(len(data)))
    elif where == "after-header":
        data[100:] = bytes(rng.getrandbits(8) for _ in range(len(data) - 100))
    else:
        # Inside every stored plan's bytes: SQLite's structure stays sound,
        # the entries' checksums do not.
        import sqlite3

        con = sqlite3.connect(db)
        blobs = [row[0] for row in con.execute("SELECT data FROM plans")]
        con.close()
        for blob in blobs:
            # A 16-byte run of the entry that occurs once in the file (runs
            # that straddle an overflow page boundary are not found).
            for off in range(len(blob) // 2, len(blob) - 16, 61):
                run = bytes(blob[off : off + 16])
                if data.count(run) == 1:
                    at = data.find(run)
                    data[at : at + 16] = bytes(b ^ 0xFF for b in run)
                    break
            else:
                raise AssertionError("no unique run found")
    db.write_bytes(bytes(data))
    _expect_fallback(tmp_path, plans)


def test_verify_raises_cache_error_on_an_unreadable_file_and_clear_repairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plans-v1.sqlite").write_bytes(b"not a database" * 1000)
    with pytest.raises(CacheError):
        PlanCache(tmp_path).verify()
    assert issubclass(CacheError, deeppart.DeepPartError)
    assert cli_main(["cache", "verify", "--dir", str(tmp_path)]) == 2
    assert "CacheError" in capsys.readouterr().err
    assert cli_main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert PlanCache(tmp_path).verify()["entries"] == 0


def test_another_planner_version_misses(tmp_path: Path) -> None:
    m = make_manifest(3)
    old = PlanCache(tmp_path, planner_version="0.0.0+old")
    assert deeppart.plan(m, WORLD, cache=old).stats.source == "computed"
    assert (
        deeppart.plan(m, WORLD, cache=PlanCache(tmp_path, planner_version="0.0.0+old")).stats.source
        == "disk"
    )
    new = PlanCache(tmp_path)
    assert deeppart.plan(m, WORLD, cache=new).stats.source == "computed"
    assert new.stats()["stale"] == 1
    assert deeppart.plan(m, WORLD, cache=PlanCache(tmp_path)).stats.source == "disk"
    # The fingerprint itself carries the real planner version.
    assert deeppart.PLANNER_VERSION and len(deeppart.plan(m, WORLD, cache=False).fingerprint) == 64


@pytest.mark.parametrize(
    "change",
    [
        {"fixed_s": 3e-3},
        {"piece_s": 21e-6},
        {"bandwidth": 2e9},
        {"writer_s": 1e-4},
        {"min_piece_bytes": 1 << 19},
    ],
)
def test_any_cost_parameter_change_misses(tmp_path: Path, change: dict[str, Any]) -> None:
    m = make_manifest(4)
    cache = PlanCache(tmp_path)
    base = deeppart.plan(m, WORLD, cost=deeppart.CostModel(), cache=cache)
    other = deeppart.plan(m, WORLD, cost=deeppart.CostModel(**change), cache=cache)
    assert (base.stats.source, other.stats.source) == ("computed", "computed")
    assert other.fingerprint != base.fingerprint
    fresh = PlanCache(tmp_path)
    assert (
        deeppart.plan(m, WORLD, cost=deeppart.CostModel(**change), cache=fresh).stats.source
        == "disk"
    )
    topo = deeppart.plan(m, WORLD, topology=deeppart.Topology(2), cache=fresh)
    algo = deeppart.plan(m, WORLD, algorithm="lpt", cache=fresh)
    assert (topo.stats.source, algo.stats.source) == ("computed", "computed")


def test_the_cache_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = make_manifest(5)
    monkeypatch.setenv("DEEPPART_CACHE_DIR", str(tmp_path / "default"))
    assert deeppart.default_cache_dir() == str(tmp_path / "default")
    assert deeppart.plan(m, WORLD).stats.source == "computed"
    assert deeppart.plan(m, WORLD, cache=True).stats.source == "memory"
    assert (tmp_path / "default" / "plans-v1.sqlite").exists()
    assert deeppart.plan(m, WORLD, cache=False).stats.source == "computed"
    assert deeppart.plan(m, WORLD, cache=str(tmp_path / "p")).stats.source == "computed"
    assert deeppart.plan(m, WORLD, cache=tmp_path / "p").stats.source == "memory"
    assert deeppart.plan(m, WORLD, cache=PlanCache(tmp_path / "p")).stats.source == "disk"
    monkeypatch.chdir(tmp_path)
    assert PlanCache("rel").directory == str(tmp_path / "rel")
    mem = PlanCache(disk=False)
    assert mem.directory is None and mem.stats()["disk"] == "none"
    assert [deeppart.plan(m, WORLD, cache=mem).stats.source for _ in range(2)] == [
        "computed",
        "memory",
    ]
    with pytest.raises(TypeError):
        deeppart.plan(m, WORLD, cache=3)  # type: ignore[arg-type]
    monkeypatch.delenv("DEEPPART_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert deeppart.default_cache_dir() == str(tmp_path / "xdg" / "deeppart")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert deeppart.default_cache_dir() == str(tmp_path / "home" / ".cache" / "deeppart")
    assert PlanCache().directory == str(tmp_path / "home" / ".cache" / "deeppart")


def test_an_unusable_directory_warns_once_and_plans(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cache = PlanCache(tmp_path / "file" / "sub")  # a directory under a file
    m = make_manifest(6)
    with pytest.warns(CacheWarning, match="unusable") as record:
        plans = [deeppart.plan(m, WORLD, cache=cache) for _ in range(3)]
        cache.stats()
    assert len(record) == 1
    assert [p.stats.source for p in plans] == ["computed", "memory", "memory"]
    assert cache.stats()["disk"].startswith("disabled")
    with pytest.raises(CacheError):
        cache.verify()


def test_invalid_inputs_still_raise_plan_errors(tmp_path: Path) -> None:
    m = make_manifest(7)
    with pytest.raises(deeppart.PlanError):
        deeppart.plan(m, 0, cache=PlanCache(tmp_path))
    with pytest.raises(deeppart.PlanError):
        deeppart.plan(m, WORLD, algorithm="nope", cache=PlanCache(tmp_path))


def test_size_cap_evicts_least_recently_used(tmp_path: Path) -> None:
    probe = PlanCache(tmp_path / "probe")
    deeppart.plan(make_manifest(40), WORLD, cache=probe)
    one = probe.stats()["bytes"]
    cache = PlanCache(tmp_path / "capped", max_bytes=int(one * 3.5), memory_entries=0)
    for k in range(40, 46):
        deeppart.plan(make_manifest(k), WORLD, cache=cache)
    s = cache.stats()
    assert s["evictions"] >= 2
    assert s["bytes"] <= one * 3.5
    assert deeppart.plan(make_manifest(45), WORLD, cache=cache).stats.source == "disk"


def test_memory_tier_is_bounded(tmp_path: Path) -> None:
    cache = PlanCache(disk=False, memory_entries=2)
    for k in range(50, 54):
        deeppart.plan(make_manifest(k, 50), WORLD, cache=cache)
    s = cache.stats()
    assert (s["memory_entries"], s["memory_evictions"]) == (2, 2)
    assert deeppart.plan(make_manifest(53, 50), WORLD, cache=cache).stats.source == "memory"
    assert deeppart.plan(make_manifest(50, 50), WORLD, cache=cache).stats.source == "computed"


def test_cli_stats_clear_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deeppart.plan(make_manifest(8), WORLD, cache=PlanCache(tmp_path))
    assert cli_main(["cache", "stats", "--dir", str(tmp_path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 1 and stats["bytes"] > 0
    assert cli_main(["cache", "verify", "--dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["valid"] == 1
    assert cli_main(["cache", "clear", "--dir", str(tmp_path)]) == 0
    assert "removed" in capsys.readouterr().out
    assert PlanCache(tmp_path).stats()["entries"] == 0


def test_a_forked_child_opens_its_own_connection(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    deeppart.plan(make_manifest(60), WORLD, cache=cache)  # the database is open now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            p = deeppart.plan(make_manifest(61), WORLD, cache=cache)
            q = deeppart.plan(make_manifest(60), WORLD, cache=PlanCache(tmp_path))
            code = 0 if (p.stats.source, q.stats.source) == ("computed", "disk") else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert PlanCache(tmp_path).verify()["valid"] == 2
    assert deeppart.plan(make_manifest(61), WORLD, cache=cache).stats.source == "disk"
