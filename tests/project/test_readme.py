"""Every ```python and ```bash block of README.md and of the docs pages
behind it (``PAGES``, in that order) runs, as written, in a fresh process,
and says what it claims; every relative link of README.md and docs/
resolves.

- A block preceded by the line ``<!-- readme: fragment -->`` is a fragment
  (it names the reader's own objects or paths) and is not run.
- A block preceded by ``<!-- readme: file NAME -->`` (any language) is a
  file the following blocks use: it is written to ``NAME`` first.
- A Python block whose first line is a comment naming a launch command
  that ends in ``train.py`` (``# mpiexec -n 2 python train.py``,
  ``# python -m torch.distributed.run ... train.py``) is saved as
  ``train.py`` and run with that command; any other Python block with
  ``python``.
- A bash block runs under ``set -e``; its comment lines that start at the
  beginning of a line (``# rank 0/2: ...``) are output it must print.
- The blocks run in order, page by page, in one working directory (as a
  reader who follows the README, then the pages of docs/index.md), with
  ``examples/`` linked from the repository; so later blocks may use what
  earlier ones wrote (``ckpt/step-100``).
- The first block names the two top commands: the demo is run (what
  ``scripts/demo.sh`` runs after its set-up: ``deeppart demo``), and
  ``scripts/test.sh`` is not, as it runs this test.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from launching import run_in_session

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages_in_reading_order() -> tuple[str, ...]:
    """README.md, then the docs pages in the order docs/index.md first links
    them: the order their blocks run in (later pages use what earlier ones
    wrote, as a reader who follows the index)."""
    linked = re.findall(r"\]\(([A-Za-z0-9_]+\.md)[)#]", (DOCS / "index.md").read_text())
    ordered = [f"docs/{name}" for name in dict.fromkeys(linked)]
    return ("README.md", *ordered)


PAGES = pages_in_reading_order()
FRAGMENT = "<!-- readme: fragment -->"
FILE = re.compile(r"<!-- readme: file (\S+) -->")
RUN = ("python", "bash")
TIMEOUT_S = 600
MPIEXEC = Path(sys.executable).parent / "mpiexec"


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    fragment: bool
    file: str | None  # written to this name, not run

    @property
    def runnable(self) -> bool:
        return self.lang in RUN and not self.fragment and self.file is None

    def name(self) -> str:
        return f"{self.page}:{self.line} ({self.lang})"


def blocks(text: str, page: str = "README.md") -> list[Block]:
    """The fenced blocks of ``text`` (the page ``page``) with what precedes
    each."""
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        named = FILE.fullmatch(before)
        out.append(
            Block(
                page=page,
                line=i + 1,
                lang=m.group(1),
                text="\n".join(lines[i + 1 : j]) + "\n",
                fragment=before == FRAGMENT,
                file=named.group(1) if named else None,
            )
        )
        i = j + 1
    return out


def launch_of(block: Block) -> str:
    """The shell command that runs a Python block saved as train.py."""
    first = block.text.splitlines()[0] if block.text.strip() else ""
    m = re.match(r"#\s*(.*?\btrain\.py)\b", first)
    return m.group(1) if m else "python train.py"


def expected_output(block: Block) -> list[str]:
    return [ln[2:].strip() for ln in block.text.splitlines() if ln.startswith("# ")]


def top_commands(block: Block) -> str:
    """The first block as it is run here: the demo's own command instead of
    its set-up script, and not the test suite (this test is in it)."""
    lines = []
    for ln in block.text.splitlines():
        cmd = ln.split("#", 1)[0].strip()
        if cmd == "bash scripts/test.sh":
            continue
        if cmd.startswith("bash scripts/demo.sh"):
            cmd = "deeppart demo --ranks 4" + cmd[len("bash scripts/demo.sh") :]
        if cmd:
            lines.append(cmd)
    return "\n".join(lines) + "\n"


def environment() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return dict(
        os.environ,
        PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        MPLBACKEND="Agg",
    )


def run_block(block: Block, cwd: Path, script: str | None = None) -> str:
    """Runs one block in ``cwd``; fails with the block and its output if it
    exits non-zero or does not print what it says."""
    if block.lang == "python":
        (cwd / "train.py").write_text(block.text)
        command = launch_of(block)
    else:
        command = script if script is not None else block.text
    path = cwd / "block.sh"
    path.write_text("set -euo pipefail\n" + command)
    rc, out = run_in_session(["bash", str(path)], environment(), cwd, TIMEOUT_S)
    assert rc == 0, f"{block.name()} failed (rc={rc}):\n{block.text}\n--- output:\n{out[-6000:]}"
    if block.lang == "bash" and script is None:
        for want in expected_output(block):
            assert want in out, f"{block.name()} did not print {want!r}:\n{out[-6000:]}"
    return out


def workdir(tmp_path: Path) -> Path:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return tmp_path


def page_text(page: str) -> str:
    return (ROOT / page).read_text()


README_BLOCKS = blocks(README.read_text())
ALL = README_BLOCKS + [b for page in PAGES[1:] for b in blocks(page_text(page), page)]
TOP = README_BLOCKS[0]


def test_every_block_is_runnable_or_marked() -> None:
    """The blocks of README.md and its pages: each python/bash block runs
    here unless it is marked a fragment, and only that exact marker line
    marks one. README.md begins with the two top commands, and its first
    Python block is a 2-rank MPI job."""
    assert PAGES[0] == "README.md" and ALL[: len(README_BLOCKS)] == README_BLOCKS
    assert sum(b.runnable for b in ALL) >= 7, [b.name() for b in ALL if b.runnable]
    for page in PAGES:
        for line in page_text(page).splitlines():
            if "readme:" in line and line.strip().startswith("<!--"):
                assert line.strip() == FRAGMENT or FILE.fullmatch(line.strip()), (page, line)
    assert TOP.line == 3 and TOP.runnable and "scripts/demo.sh" in TOP.text
    assert "bash scripts/test.sh" in TOP.text
    assert "deeppart demo --ranks 4" in top_commands(TOP)
    assert "test.sh" not in top_commands(TOP)
    demo_sh = (ROOT / "scripts" / "demo.sh").read_text()
    assert "deeppart demo --ranks 4" in demo_sh  # what top_commands runs instead
    for b in ALL:
        if b.lang == "python" and b.runnable:
            compile(b.text, b.name(), "exec")
    first = next(b for b in README_BLOCKS if b.runnable and b.lang == "python")
    assert launch_of(first).startswith("mpiexec -n 2 python")


def test_every_docs_page_is_in_the_index_and_run() -> None:
    """docs/index.md links every docs page, so each one's blocks run (in
    PAGES)."""
    index = page_text("docs/index.md")
    for path in sorted(DOCS.glob("*.md")):
        page = path.relative_to(ROOT).as_posix()
        if page == "docs/index.md":
            continue
        assert f"]({path.name}" in index, f"docs/index.md does not link {path.name}"
        assert page in PAGES, page
    assert "docs/CLI.md" in PAGES and "docs/ERASURE.md" in PAGES


FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """``text`` without its code: fenced blocks and code spans."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of ``text``: lowercased,
    punctuation but ``-`` and ``_`` dropped, spaces to ``-``; a repeated
    one gets ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        words = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", words.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(text: str) -> list[str]:
    return [
        t
        for t in LINK.findall(prose(text))
        if not re.match(r"[a-z][a-z0-9+.-]*:", t)  # https:, mailto:
    ]


@pytest.mark.parametrize(
    "page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md"))]
)
def test_relative_links_resolve(page: str) -> None:
    """Every relative link of the page names a file of the repository, and
    its #anchor a heading of that page, spelled alike on GitHub and in the
    mkdocs site."""
    source = ROOT / page
    broken = []
    for target in relative_links(source.read_text()):
        path, _, anchor = target.partition("#")
        dest = (source.parent / path).resolve() if path else source
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
        elif "--" in anchor:  # mkdocs (mkdocs.yml) folds it to one "-", GitHub does not
            broken.append(f"{target}: an anchor with '--' differs on GitHub and in the site")
    assert not broken, f"{page}:\n" + "\n".join(broken)


def test_the_link_check_finds_what_it_must() -> None:
    """The checker itself: a link in a code block is not a link, a heading's
    anchor follows GitHub's rule, a missing heading is not an anchor."""
    text = "# A `b` (c), D\u2013E\n## A b c de\n[x](y.md#z) `[u](v.md)`\n```\n[p](q.md)\n```\n"
    assert relative_links(text) == ["y.md#z"]
    assert anchors(text) == {"a-b-c-de", "a-b-c-de-1"}
    assert "z" not in anchors(text) and "a-b-c-de-2" not in anchors(text)
    assert relative_links("[s](https://x.org/a) [t](#h)") == ["#h"]


def paragraph_before(block: Block, text: str) -> str:
    """The prose between the previous block (or heading) and ``block``."""
    lines = text.splitlines()[: block.line - 1]
    out: list[str] = []
    for ln in reversed(lines):
        if ln.startswith(("```", "#")):
            break
        out.append(ln)
    return " ".join(reversed(out))


def test_blocks_that_need_the_repository_say_so() -> None:
    """The blocks run in the reader's directory: one that names a file of
    the repository (``examples/...``) says, right before it, that it runs
    from the repository root; ``deeppart plan`` examples use a manifest an
    earlier line of the same block writes."""
    for b in ALL:
        if b.runnable and "examples/" in b.text:
            assert "repository root" in paragraph_before(b, page_text(b.page)), b.name()
    cli = next(b for b in ALL if b.runnable and "deeppart plan " in b.text)
    assert "examples/" not in cli.text, cli.name()
    first_plan = cli.text.index("deeppart plan ")
    for target in re.findall(r"deeppart plan (\S+\.json)", cli.text):
        assert f"-o {target}" in cli.text[:first_plan], (cli.name(), target)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_readme_blocks_run_in_order(tmp_path: Path) -> None:
    cwd = workdir(tmp_path)
    for b in ALL:
        if b is TOP:
            continue
        if b.file is not None:
            (cwd / b.file).write_text(b.text)
        elif b.runnable:
            run_block(b, cwd)
    # What the blocks say they write.
    for made in (
        "ckpt/step-100/COMMITTED",
        "ckpt/step-00000100/COMMITTED",
        "ckpt/accelerate/COMMITTED",
        "ckpt-levels/meta/deeppart/step-00000040/COMMITTED",
        "manifest.json",
        "bert.json",
        "scaling.png",
        "hf-model/model.safetensors",
        "state.pt",
        "ckpt/imported/COMMITTED",
    ):
        assert (cwd / made).exists(), made


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_readme_top_commands(tmp_path: Path) -> None:
    """The first block: the 4-rank demo (checkpoint, crash, recovery,
    bitwise check) passes; scripts/test.sh is this suite, not run again."""
    script = top_commands(TOP)
    assert shlex.split(script.splitlines()[0])[:2] == ["deeppart", "demo"]
    out = run_block(TOP, workdir(tmp_path), script=script)
    assert "ALL CHECKS PASSED" in out and "BITWISE IDENTICAL" in out, out[-4000:]
