"""Every command README.md and docs/*.md write runs as written: each program a document starts
(`python -m MODULE ...`, `python examples/NAME.py ...`, `python experiments/...py ...`, in fenced
code blocks and in inline code) answers `--help` with exit 0 and a usage line, and every
`--flag` the documents give it is one its help lists, with a value among its choices where the
help lists choices. Each program's `--help` runs once, two at a time."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest

from testenv import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
# A program and what follows it up to the end of its command (a comment, a pipe, a `&&`, `;`).
COMMAND = re.compile(r"(?<![\w/.-])python3?\s+(?:-m\s+(?P<module>[A-Za-z_][\w.]*)"
                     r"|(?P<script>(?:examples|experiments)/[\w/]+\.py))(?P<rest>[^#|;&]*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
# Flags the documents name that a program's --help hides on purpose (argparse.SUPPRESS): the
# protocol between a parent process and the worker it starts, not something a user types.
HIDDEN = {("-m jaxmem.memory", "--worker")}


def own_flags(rest: str) -> list[tuple[str, str]]:
    """(flag, the word after it) of a command's own program: those before a lone `--` (which
    passes the rest on, as `python -m jaxmem.launch ... -- --steps 50` does)."""
    words = re.split(r"\s--(?:\s|$)", rest)[0].split()
    return [(w.split("=")[0], w.split("=", 1)[1] if "=" in w else
             (words[i + 1] if i + 1 < len(words) else "")) for i, w in enumerate(words)
            if FLAG.fullmatch(w.split("=")[0])]


def choices(help_text: str) -> dict[str, set[str]]:
    """{flag: its choices} where argparse's help shows them (`--flag {a,b,c}`)."""
    return {flag: set(c.split(",")) for flag, c in
            re.findall(r"(?<![\w-])(--[a-z][\w-]*)[ =]\{([^}\s]+)\}", help_text)}


def snippets(text: str) -> list[str]:
    """The fenced code blocks and the lines indented as code (one command per line, backslash
    continuations joined), and the inline code spans of the rest (a span may break across
    lines)."""
    out = []
    for block in FENCE.findall(text):
        out += block.replace("\\\n", " ").splitlines()
    prose = FENCE.sub("", text)
    out += [line for line in prose.replace("\\\n", " ").splitlines() if line.startswith("    ")]
    out += [s.replace("\n", " ") for s in INLINE.findall(prose)]
    return out


def documented() -> dict[str, dict[str, set[str]]]:
    """{program: {flag: {document, ...}}}; a program is `-m MODULE` or a script's path."""
    found: dict[str, dict[str, set[str]]] = {}
    for doc in DOCS:
        for snippet in snippets(doc.read_text()):
            for m in COMMAND.finditer(snippet):
                prog = f"-m {m['module']}" if m["module"] else m["script"]
                flags = found.setdefault(prog, {})
                flags.setdefault("", set()).add(doc.name)
                for flag, value in own_flags(m["rest"]):
                    flags.setdefault(flag, set()).add(doc.name)
                    if value and not value.startswith("-"):
                        flags.setdefault(f"{flag} {value}", set()).add(doc.name)
    return found


PROGRAMS = documented()


@lru_cache(maxsize=None)
def helps() -> dict[str, subprocess.CompletedProcess]:
    def run(prog: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *prog.split(), "--help"], cwd=ROOT,
                              env=subprocess_env(cpu=True), capture_output=True, text=True,
                              timeout=300)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(PROGRAMS, pool.map(run, PROGRAMS)))


def test_the_documents_name_programs():
    assert {"-m experiments.compare", "-m experiments.gpu_check", "-m experiments.fp8_diag",
            "-m jaxmem.train", "-m jaxmem.memory"} <= set(PROGRAMS), sorted(PROGRAMS)


def test_snippets_read_fenced_and_inline_commands():
    text = ("Run `python -m a.b --x 1\n--y` or\n\n```bash\nPYTHONPATH=. python -m c --z \\\n"
            "  --w 2   # --not-a-flag\npython examples/e.py --v -- --train-flag | tail\n```\n"
            "or\n\n    python -m f --u \\\n        --t   # indented\n")
    got = {}
    for s in snippets(text):
        for m in COMMAND.finditer(s):
            got[m["module"] or m["script"]] = [f for f, _ in own_flags(m["rest"])]
    assert got == {"a.b": ["--x", "--y"], "c": ["--z", "--w"], "examples/e.py": ["--v"],
                   "f": ["--u", "--t"]}
    assert own_flags(" --r 16 --s=a --q -- --steps 5") == [("--r", "16"), ("--s", "a"), ("--q", "")]
    assert choices("  --dtype {float32,bfloat16}  help\n  --n N") == {"--dtype": {"float32", "bfloat16"}}


@pytest.mark.parametrize("prog", sorted(PROGRAMS))
def test_documented_command_answers_help_with_its_flags(prog):
    p = helps()[prog]
    docs = sorted(PROGRAMS[prog][""])
    assert p.returncode == 0, f"`python {prog} --help` (written in {docs}) exited " \
                              f"{p.returncode}: {p.stderr[-1500:]}"
    assert re.search(r"^usage:", p.stdout, re.M | re.I), (prog, p.stdout[:500])
    given = [f for f in PROGRAMS[prog] if f and " " not in f]
    unknown = {flag: sorted(PROGRAMS[prog][flag]) for flag in given if (prog, flag) not in HIDDEN
               and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", p.stdout)}
    assert not unknown, f"`python {prog}`: flags the documents give that --help lacks: {unknown}"
    allowed = choices(p.stdout)
    bad = {fv: sorted(where) for fv, where in PROGRAMS[prog].items() if " " in fv
           and fv.split()[0] in allowed and fv.split()[1].strip("'\"`,") not in allowed[fv.split()[0]]}
    assert not bad, f"`python {prog}`: values the documents give that are not among the " \
                    f"choices --help lists: {bad}"
