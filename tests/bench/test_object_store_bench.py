"""bench/object_store.py's pure parts: the rate syntax, the within-round
ratios, the simulator's prediction and the report, which must show a
contender that could not run as such (never a number). The benchmark
itself needs root, network namespaces, tc and an S3 server: it is run by
hand (docs/BENCHMARKS.md, "Object storage")."""

from __future__ import annotations

import argparse

import pytest

from bench import object_store


def test_rate_bytes_reads_tc_syntax() -> None:
    assert object_store.rate_bytes("100mbit") == pytest.approx(12.5e6)
    assert object_store.rate_bytes("1gbit") == pytest.approx(125e6)
    assert object_store.rate_bytes("50mbps") == pytest.approx(50e6)
    with pytest.raises(ValueError, match="bad rate"):
        object_store.rate_bytes("fast")


def test_median_ratio_pairs_rounds_and_refuses_a_failed_round() -> None:
    rounds: dict[str, list[float | None]] = {
        "save torch": [4.0, 9.0, 6.0],
        "save deeppart": [1.0, 1.0, 3.0],
    }
    # Within-round ratios 4, 9, 2: their median, not a ratio of medians (6/1).
    assert object_store._median_ratio(rounds, "save torch", "save deeppart") == 4.0
    rounds["save dcp"] = [2.0, None, 2.0]
    assert object_store._median_ratio(rounds, "save dcp", "save deeppart") is None
    assert object_store._median(rounds["save dcp"]) is None


def _result(nodes: int, deeppart: bool, per_node: int = 1) -> dict[str, object]:
    rounds: dict[str, list[float | None]] = {
        "save torch": [8.0, 8.0],
        "save dcp": [2.5, 3.0],
        "load torch": [4.0, 4.2],
        "load dcp": [4.5, 4.4],
    }
    available: dict[str, str | None] = {"torch": None, "dcp": None, "deeppart": None}
    if deeppart:
        rounds["save deeppart"] = [2.0, 2.0]
        rounds["load deeppart"] = [4.0, 4.0]
    else:
        available["deeppart"] = "UnsupportedURLError: no S3 here"
    predicted = {"torch.save": 8.0, "balanced": 2.0, "dcp-dedup": 2.0}
    return {
        "nodes": nodes, "ranks": nodes * per_node, "bytes": 52_000_000, "rounds": rounds,
        "available": available,
        "verified": {"torch": True, "dcp": True}, "notes": {}, "dcp": "s3torchconnector",
        "predicted": predicted,
    }  # fmt: skip


META = {
    "scale": 0.04, "hidden": 512, "rate": "100mbit", "server": "s3s-fs", "repeat": 2,
    "tcp": "reno", "host_tcp": "bbr",
    "link": {"put": 12e6, "get": 12e6}, "raw": {"put": 100e6, "get": 250e6},
    "loadavg_start": "1.0 1.0 1.0", "loadavg_end": "1.0 1.0 1.0", "compression": "none",
}  # fmt: skip


def test_report_shows_ratios_and_predictions() -> None:
    text = object_store.report([_result(4, deeppart=True)], META)
    save = text.split("\nload:")[0].splitlines()[-1].split()
    # nodes, torch, dcp, deeppart (medians), torch/dp, dcp/dp, torch/dcp (medians of
    # within-round ratios: 8/2.5 and 8/3 give 2.93), predicted s, predicted ratios
    assert save[:7] == ["4x1", "8.00", "2.75", "2.00", "4.00x", "1.38x", "2.93x"]
    assert save[7:] == ["2.00s", "4.00x", "1.00x"]
    # The links' TCP is part of the conditions (it decides how a link
    # carries both directions at once): the header names it and the host's.
    assert "TCP reno (the host's default: bbr)" in text.splitlines()[0]


def test_report_compares_the_compressed_contenders() -> None:
    """With --compression: DCP with its ZStandard extension and DeepPart
    compressed get their own columns and their ratios, DeepPart's against
    torch.save, DCP and DCP compressed; the header names the codec."""
    result = _result(4, deeppart=True)
    rounds = result["rounds"]
    assert isinstance(rounds, dict)
    rounds["save dcp-zstd"] = [2.4, 2.4]
    rounds["save dp-zstd"] = [1.6, 2.0]
    text = object_store.report([result], {**META, "compression": "shuffle-zstd"})
    assert "dp-zstd: compression=shuffle-zstd" in text
    save = text.split("\nload:")[0].splitlines()[-1].split()
    # nodes, torch, dcp, deeppart, dcp-zstd, dp-zstd (medians), torch/dp,
    # dcp/dp, torch/dcp, torch/dp-zstd (8/1.6, 8/2), dcp/dp-zstd (2.5/1.6,
    # 3/2), dcp-zstd/dp-zstd (2.4/1.6, 2.4/2), then the predictions
    assert save[:6] == ["4x1", "8.00", "2.75", "2.00", "2.40", "1.80"]
    assert save[6:12] == ["4.00x", "1.38x", "2.93x", "4.50x", "1.53x", "1.35x"]
    assert save[12:] == ["2.00s", "4.00x", "1.00x"]


def test_report_names_each_jobs_nodes_and_ranks_per_node() -> None:
    """One row per job, labelled nodes x ranks per node, in the tables, the
    verification lines and the notes."""
    two = _result(4, deeppart=False, per_node=2)
    text = object_store.report([_result(4, deeppart=True), two], META)
    rows = [line.split()[0] for line in text.split("\nload:")[0].splitlines()[-2:]]
    assert rows == ["4x1", "4x2"]
    assert "  4x2: torch True, dcp True, deeppart not run" in text
    assert "  4x2: deeppart: could not run: UnsupportedURLError" in text


def test_report_says_why_deeppart_did_not_run() -> None:
    text = object_store.report([_result(2, deeppart=False)], META)
    save = text.split("\nload:")[0].splitlines()[-1].split()
    assert save[3] == "n/a" and save[4] == "-" and save[5] == "-"
    assert "deeppart: could not run: UnsupportedURLError: no S3 here" in text
    assert "deeppart not run" in text


def test_prediction_scales_with_the_nodes_links() -> None:
    """One rank per node, links at 12.5 MB/s and a server far faster: the
    simulator's balanced save at 4 nodes is about 4x torch.save's."""
    args = argparse.Namespace(scale=0.04, hidden=512)
    p = object_store.predict(args, 4, link=12.5e6, server=1e9, stream=1e9)
    assert 3.5 < p["torch.save"] / p["balanced"] <= 4.0
    one = object_store.predict(args, 1, link=12.5e6, server=1e9, stream=1e9)
    assert one["torch.save"] / one["balanced"] == pytest.approx(1.0, rel=0.05)
    # Two ranks per node share a node's link: the balanced save's time at 4
    # nodes stays the link's, not halved.
    two = object_store.predict(args, 4, link=12.5e6, server=1e9, stream=1e9, per_node=2)
    assert two["balanced"] == pytest.approx(p["balanced"], rel=0.1)


def test_report_shows_the_direct_load_in_the_load_table_only() -> None:
    """DeepPart's load with exchange="read" (DIRECT) has a column and a
    dcp/dp-read ratio in the load table and its verification; the save
    table has no such column (it saves nothing of its own)."""
    result = _result(4, deeppart=True)
    rounds = result["rounds"]
    assert isinstance(rounds, dict)
    rounds[f"load {object_store.DIRECT}"] = [3.0, 4.0]
    verified = result["verified"]
    assert isinstance(verified, dict)
    verified[object_store.DIRECT] = True
    text = object_store.report([result], META)
    save, load = text.split("\nload:")[:2]
    assert object_store.DIRECT not in save.split("\n\nsave:")[1]
    head, row = load.splitlines()[1:3]
    assert head.split()[6] == object_store.DIRECT and head.split()[-1] == "dcp/dp-read"
    # dp-read's median 3.50 s; dcp/dp-read: within-round 4.5/3 and 4.4/4 -> 1.30x
    assert row.split()[4] == "3.50" and row.split()[-1] == "1.30x"
    assert f"{object_store.DIRECT} True" in text


def test_report_shows_the_bytes_through_each_nodes_link() -> None:
    """The load's bytes in and out of a node's link, by contender; a
    contender without counters shows '-', not a number."""
    result = _result(4, deeppart=True)
    result["link"] = {"load dcp": [52.0e6, 0.1e6], "load deeppart": [51.9e6, 39.0e6]}
    text = object_store.report([result], META)
    table = text.split("load: MB into / out of each node's link")[1].splitlines()
    assert table[1].split() == ["nodes", "x", "ranks", "torch", "dcp", "deeppart", "dp-read"]
    assert table[2].split() == ["4x1", "-", "52.0", "/", "0.1", "51.9", "/", "39.0", "-"]


def test_link_counters_read_this_namespaces_interface() -> None:
    """The loopback's counters (every namespace has one) grow by at least
    what is sent through it; an interface that is absent reads (0, 0)."""
    import socket

    rx0, tx0 = object_store.link_counters("lo")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        for _ in range(10):
            s.sendto(b"x" * 1000, s.getsockname())
    rx1, tx1 = object_store.link_counters("lo")
    assert rx1 - rx0 >= 10_000 and tx1 - tx0 >= 10_000
    assert object_store.link_counters("no-such-interface") == (0, 0)


def test_link_rates_bins_the_counters() -> None:
    """--trace's rates: per bin, the counters' change between its first and
    last sample over the time between them; a bin without two samples is
    (0, 0), not a rate made up from its neighbours."""
    mb = 1_000_000
    samples = [
        (0.0, 0, 0),
        (0.1, 1 * mb, 0),
        (0.2, 2 * mb, 3 * mb),  # bin 0: 2 MB in, 3 MB out in 0.2 s
        (0.3, 2 * mb, 3 * mb),
        (0.45, 5 * mb, 3 * mb),  # bin 1: 3 MB in over 0.15 s
        (0.6, 5 * mb, 3 * mb),  # bin 2: one sample only
    ]
    got = object_store.link_rates(samples, bin_s=0.25)
    assert got == [
        pytest.approx((10.0, 15.0)),
        pytest.approx((20.0, 0.0)),
        (0.0, 0.0),
    ]
    assert object_store.link_rates([]) == []


def test_trace_text_names_each_job_contender_and_rank() -> None:
    result = _result(4, deeppart=True, per_node=2)
    result["trace"] = {"deeppart": [[0, [(12.0, 0.5), (3.31, 11.9)]], [1, [(12.0, 0.0)]]]}
    text = object_store.trace_text([result, _result(2, deeppart=True)])
    assert text.splitlines()[1:] == [
        "4x2 deeppart:",
        "  rank 0: 12.0/ 0.5  3.3/11.9",
        "  rank 1: 12.0/ 0.0",
    ]


def test_sampler_reads_counters_until_stopped() -> None:
    sampler = object_store.LinkSampler()
    sampler.start()
    samples = sampler.stop()
    assert len(samples) >= 2
    assert [t for t, _, _ in samples] == sorted(t for t, _, _ in samples)
