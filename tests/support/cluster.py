"""Simulated nodes on one machine, for tests that need a real cluster's
storage and network (tests/levels/test_cluster.py; run as root).

Each :class:`Cluster` node ``k`` is a mount namespace with a private tmpfs
at :attr:`Cluster.local` (the node-local ``ckpt_dir``: no other node sees
its files) and a UTS namespace with host name ``dpnode<k>``. With
``net=True`` each node also has its own network namespace, with ``eth0``
(10.77.<id>.<k+1>) on a bridge in a head namespace (10.77.<id>.254): MPI
then runs over TCP between the nodes (hydra's ssh launcher through
:attr:`Cluster.fake_ssh`, UCX forced onto tcp).

Ranks enter their node through :attr:`Cluster.enter` (k from ``PMI_RANK``
and the node order of the launch), so a launch can reorder the nodes, as
a scheduler does after a replacement. :meth:`Cluster.replace` gives a
node fresh, empty storage; :meth:`Cluster.close` removes everything, and
:func:`sweep` what an earlier, killed run left (its owner process is gone).
Everything the harness makes lives under ``/tmp/deeppart-cluster/<id>/``
(namespace files are bind mounts there; network namespaces are named
``dpc<id>...``), so the sweep finds it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BASE = Path("/tmp/deeppart-cluster")
ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"

# The wrapper a rank starts through: enters its node's namespaces.
# DP_CLUSTER_ORDER lists the node of each slot of DP_CLUSTER_PPN ranks.
_ENTER = """#!/bin/sh
set -e
r=${PMI_RANK:?not started by mpiexec}
slot=$((r / DP_CLUSTER_PPN + 1))
k=$(echo "$DP_CLUSTER_ORDER" | cut -d, -f$slot)
exec nsenter --mount=%(ns)s/mnt$k --uts=%(ns)s/uts$k --wd="$PWD" -- "$@"
"""

# hydra's "ssh": `fake-ssh [options] dpnode<k> command...` runs the proxy
# command inside node k's namespaces (mount, UTS, network).
_FAKE_SSH = """#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in
    -*) shift ;;
    *) break ;;
  esac
done
host=$1; shift
k=${host#dpnode}
exec nsenter --mount=%(ns)s/mnt$k --uts=%(ns)s/uts$k --net=/run/netns/%(tag)sn$k \\
  --wd="$PWD" -- sh -c "$*"
"""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why the harness cannot run here (None: it can): not root, or no
    namespaces (a container without CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return "needs root (mount and UTS namespaces)"
    for tool in ("unshare", "nsenter", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not MPIEXEC.exists():
        return f"needs mpiexec ({MPIEXEC})"
    probe = _run("unshare", "--mount", "--uts", "true", check=False)
    if probe.returncode != 0:
        return f"cannot create namespaces: {probe.stderr.strip()}"
    return None


def net_unavailable() -> str | None:
    """Why the TCP variant cannot run (None: it can)."""
    if shutil.which("ip") is None:
        return "needs ip (iproute2)"
    probe = _run("unshare", "--net", "ip", "link", "add", "dpprobe", "type", "bridge", check=False)
    if probe.returncode != 0:
        return f"cannot create network namespaces with a bridge: {probe.stderr.strip()}"
    return None


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or under ``path`` in this mount namespace, deepest first."""
    out: list[str] = []
    prefix = str(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                out.append(point)
    return sorted(out, key=len, reverse=True)


def _remove(directory: Path, tag: str) -> None:
    """Unmounts and removes what a cluster made (its directory, its
    network namespaces ``<tag>...``)."""
    for point in _mounts_under(directory):
        _run("umount", "-l", point, check=False)
    if shutil.which("ip"):
        listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
        for line in listed:
            name = line.split(" ")[0]
            if name.startswith(tag):
                _run("ip", "netns", "delete", name, check=False)
    shutil.rmtree(directory, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Removes what earlier runs whose owner process has died left behind
    (a test run killed before its teardown). Returns what it removed."""
    removed: list[str] = []
    if not BASE.is_dir():
        return removed
    for d in BASE.iterdir():
        try:
            owner = int((d / "owner").read_text())
        except (OSError, ValueError):
            owner = -1
        if owner > 0 and _alive(owner):
            continue
        _remove(d, f"dpc{d.name}")
        removed.append(str(d))
    return removed


class Cluster:
    """``nodes`` simulated nodes (see the module docstring). Use as a
    context manager, or call :meth:`close`: it tears down also when the
    test fails."""

    def __init__(self, nodes: int, *, net: bool = False) -> None:
        BASE.mkdir(parents=True, exist_ok=True)
        self.nodes = nodes
        self.net = net
        ident = 0
        while True:  # a free small id: it is also the subnet's third byte
            ident += 1
            self.dir = BASE / str(ident)
            try:
                self.dir.mkdir()
                break
            except FileExistsError:
                if ident > 250:
                    raise RuntimeError(f"{BASE}: no free cluster id (run sweep())") from None
        self.id = ident
        self.tag = f"dpc{ident}"
        (self.dir / "owner").write_text(str(os.getpid()))
        self.ns = self.dir / "ns"
        #: The node-local path: a private tmpfs on every node.
        self.local = self.dir / "local"
        #: Shared storage (meta_dir, glbl_dir): one directory all nodes see.
        self.shared = self.dir / "shared"
        for d in (self.ns, self.local, self.shared):
            d.mkdir()
        self.enter = self.dir / "enter"
        self.fake_ssh = self.dir / "fake-ssh"
        self.hosts_file = self.dir / "hosts"
        try:
            _run("mount", "--bind", str(self.ns), str(self.ns))
            _run("mount", "--make-private", str(self.ns))
            if net:
                self._make_net()
            for k in range(nodes):
                self._make_node(k)
            self._write_scripts()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------

    def host(self, k: int) -> str:
        return f"dpnode{k}"

    def ip(self, k: int) -> str:
        return f"10.77.{self.id}.{k + 1}"

    def _make_net(self) -> None:
        head = f"{self.tag}head"
        _run("ip", "netns", "add", head)
        _run("ip", "-n", head, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", head, "addr", "add", f"10.77.{self.id}.254/24", "dev", "br0")
        _run("ip", "-n", head, "link", "set", "br0", "up")
        _run("ip", "-n", head, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost", f"10.77.{self.id}.254 dphead"]
        for k in range(self.nodes):
            name = f"{self.tag}n{k}"
            _run("ip", "netns", "add", name)
            _run("ip", "-n", head, "link", "add", f"v{k}", "type", "veth", "peer", "eth0",
                 "netns", name)  # fmt: skip
            _run("ip", "-n", head, "link", "set", f"v{k}", "master", "br0", "up")
            _run("ip", "-n", name, "addr", "add", f"{self.ip(k)}/24", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            lines.append(f"{self.ip(k)} {self.host(k)}")
        self.hosts_file.write_text("\n".join(lines) + "\n")

    def _make_node(self, k: int) -> None:
        mnt, uts = self.ns / f"mnt{k}", self.ns / f"uts{k}"
        mnt.touch()
        uts.touch()
        inner = f"hostname {self.host(k)} && mount -t tmpfs -o size=1g tmpfs {self.local}"
        if self.net:
            inner += f" && mount --bind {self.hosts_file} /etc/hosts"
        _run("unshare", f"--mount={mnt}", f"--uts={uts}", "--propagation", "private",
             "sh", "-c", inner)  # fmt: skip

    def _write_scripts(self) -> None:
        values = {"ns": str(self.ns), "tag": self.tag}
        self.enter.write_text(_ENTER % values)
        self.fake_ssh.write_text(_FAKE_SSH % values)
        for p in (self.enter, self.fake_ssh):
            p.chmod(0o755)

    # ------------------------------------------------------------------
    # Operations.

    def nsenter(self, k: int) -> list[str]:
        """The command prefix that runs a command on node ``k``."""
        cmd = ["nsenter", f"--mount={self.ns}/mnt{k}", f"--uts={self.ns}/uts{k}"]
        if self.net:
            cmd.append(f"--net=/run/netns/{self.tag}n{k}")
        return [*cmd, f"--wd={ROOT}", "--"]

    def on_node(self, k: int, *cmd: str, env: dict[str, str] | None = None,
                timeout_s: float = 300) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Runs ``cmd`` on node ``k`` (its storage and host name)."""
        return subprocess.run(
            [*self.nsenter(k), *cmd],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )

    def replace(self, k: int) -> None:
        """Node ``k`` replaced: its storage is a fresh, empty tmpfs (same host name)."""
        prefix = self.nsenter(k)
        _run(*prefix, "umount", "-l", str(self.local))
        _run(*prefix, "mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", str(self.local))

    def files(self, k: int) -> list[str]:
        """Every file on node ``k``'s local storage (relative paths, sorted)."""
        out = self.on_node(k, "find", str(self.local), "-type", "f").stdout.split()
        return sorted(os.path.relpath(p, self.local) for p in out)

    def net_bytes(self) -> int:
        """Bytes that crossed the bridge between the nodes so far (net=True):
        what each node's eth0 sent, counted on its veth's far end."""
        import json

        out = _run("ip", "-n", f"{self.tag}head", "-s", "-j", "link", "show").stdout
        return sum(
            int(link["stats64"]["rx"]["bytes"])
            for link in json.loads(out)
            if str(link.get("ifname", "")).startswith("v")
        )

    def launch_cmd(self, nranks: int, order: Sequence[int], argv: Sequence[str]) -> list[str]:
        """The mpiexec command that runs ``argv`` as ``nranks`` ranks, the
        ranks of slot ``i`` (``nranks // len(order)`` consecutive ranks) on
        node ``order[i]``."""
        if self.net:
            hosts = ",".join(f"{self.host(k)}:{nranks // len(order)}" for k in order)
            return [
                "nsenter", f"--net=/run/netns/{self.tag}head", "--",
                str(MPIEXEC), "-launcher", "ssh", "-launcher-exec", str(self.fake_ssh),
                "-iface", "br0", "-hosts", hosts, "-n", str(nranks), *argv,
            ]  # fmt: skip
        return [str(MPIEXEC), "-n", str(nranks), str(self.enter), *argv]

    def launch_env(self, nranks: int, order: Sequence[int]) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            DP_CLUSTER_PPN=str(nranks // len(order)),
            DP_CLUSTER_ORDER=",".join(str(k) for k in order),
            PYTHONPATH=str(ROOT),
        )
        if self.net:
            env.update(UCX_TLS="tcp,self", UCX_NET_DEVICES="eth0")
        return env

    def close(self) -> None:
        """Removes every namespace, mount and file this cluster made."""
        with contextlib.suppress(Exception):
            _remove(self.dir, self.tag)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def take_results(path: Path, key: str) -> dict[str, list[dict[str, Any]]]:
    """The rows a launch's rank 0 appended to ``path`` (JSON lines),
    grouped by ``key``; the file is removed for the next launch."""
    import json

    rows: dict[str, list[dict[str, Any]]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row[key], []).append(row)
        path.unlink()
    return rows


if __name__ == "__main__":
    # `python tests/support/cluster.py`: prints why the harness cannot run here
    # (nothing when it can); scripts/test.sh logs it as one line.
    why = unavailable()
    print(why or "", end="\n" if why else "")
