"""Write the view a blind round's reviewer reads: this checkout's library sources (retro/, native/)
and the named files of the patched fork (build/dev/llama.cpp), with the seeded-defect switches as a
release build compiles them (every switch reads false) and their comments dropped, so that no line
points at a seeded defect, and without the harness (conformance/, tests/) or any ledger.

    python tests/rounds/release_view.py /tmp/view llama.cpp/src/llama-context.cpp ...

A clause that governs the harness itself (HARNESS-08's gate) names its harness files the same way
(conformance/gate.py); its checks (conformance/cases/) are never in a view.

A defect written on the view names its line as the view shows it; tests/rounds/judge.py finds the
line a `false` (or `False`) stands for."""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORK = REPO / "build" / "dev" / "llama.cpp"
LIBRARY = ("retro", "native")
SOURCES = (".py", ".pyi", ".h", ".cpp", ".c", ".cu", ".cuh", ".comp")

# the native forms: retro_defect_on(RETRO_DEFECT_X) and the per-call snapshots' defect(...), defect_(...),
# t->defects_(...); retro_defect_on(a_variable) too
NATIVE_SWITCH = re.compile(
    r"(?:\w+->)?\b(?:retro_defect_on|defects?_?)\(RETRO_DEFECT_[A-Z0-9_]+\)|\bretro_defect_on\(\w+\)"
)
PYTHON_SWITCH = re.compile(r"(?:_checks\.)?seeded\(\"[^\"]+\"\)")
# a comment that names a seeded defect: the whole comment goes (a line that was only the comment, too)
COMMENT = re.compile(r"\s*(?://|#)\s*seeded defect.*$")
# a seeded defect named inside a longer comment: the parenthesis goes
ASIDE = re.compile(r"\s*\(seeded defect[^)]*\)")
# a statement choosing which switch applies (`const enum retro_defect x = a ? RETRO_DEFECT_A : ...;`)
# goes whole, with the comment above it: it only names the switches
CHOICE = re.compile(r"\s*const enum retro_defect \w+ =")


def released(text: str) -> str:
    out: list[str] = []
    choosing = False
    for line in text.split("\n"):
        if CHOICE.match(line):
            choosing = True
            if out and out[-1].strip().startswith("//"):
                out.pop()
        if choosing:
            choosing = not line.rstrip().endswith(";")
            continue
        line = ASIDE.sub("", NATIVE_SWITCH.sub("false", line))
        line = PYTHON_SWITCH.sub("False", line)
        stripped = COMMENT.sub("", line)
        if stripped.strip() or not line.strip():
            out.append(stripped)
    return "\n".join(out)


def write_view(dest: Path, fork_files: list[str]) -> list[Path]:
    written = []
    sources = [(REPO / top, Path(top)) for top in LIBRARY]
    for root, rel in sources:
        for path in sorted(root.rglob("*")):
            if path.suffix in SOURCES and "__pycache__" not in path.parts and path.name != "defects.h":
                written.append(_copy(path, dest / rel / path.relative_to(root)))
    for name in fork_files:  # a fork file as llama.cpp/<path>; a harness file a clause governs by its path here
        src = FORK / name.removeprefix("llama.cpp/") if name.startswith("llama.cpp/") else REPO / name
        written.append(_copy(src, dest / name))
    return written


def _copy(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(released(src.read_text(encoding="utf-8")), encoding="utf-8")
    return dst


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dest", type=Path)
    ap.add_argument(
        "fork_files",
        nargs="*",
        help="files of the patched fork, as llama.cpp/<path>, or of the harness a clause governs",
    )
    args = ap.parse_args()
    if args.dest.exists():
        shutil.rmtree(args.dest)
    written = write_view(args.dest, args.fork_files)
    named = [p for p in written if re.search(r"RETRO_DEFECT_(?!COUNT)", p.read_text(encoding="utf-8"))]
    print(f"{len(written)} files in {args.dest}")
    if named:  # a switch whose defect is chosen by a value (FAIL-04's per-site enum) keeps its names
        print(f"defect names left in: {', '.join(str(p.relative_to(args.dest)) for p in named)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
