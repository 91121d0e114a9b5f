"""Write the seeded-defect switches' X-macro list from conformance/mutants.toml, the one place a
seeded defect is defined (its ID, where it is, what it breaks): one line per defect, in the file's
order, X(enum suffix, ID), the suffix being the ID in capitals with every other character an
underscore (FAIL-04a: FAIL_04A; BASE-01.eval-period: BASE_01_EVAL_PERIOD). CMake runs it when it
configures and again whenever mutants.toml changes; an unchanged list is not rewritten, so nothing
is rebuilt for a description's sake.

    python write_defect_switches.py MUTANTS_TOML OUT_DEF
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def switch_name(defect_id: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", defect_id.upper())


def switches(mutants: Path) -> str:
    ids = [d["id"] for d in tomllib.loads(mutants.read_text(encoding="utf-8"))["defect"]]
    names = [switch_name(i) for i in ids]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise SystemExit(f"{mutants}: defect IDs that give the same switch name: {', '.join(clash)}")
    lines = [f"// generated from {mutants.name} by {Path(__file__).name}: edit that file, not this one"]
    return "\n".join([*lines, *(f'X({n}, "{i}")' for n, i in zip(names, ids, strict=True))]) + "\n"


def main(mutants: str, out: str) -> None:
    text, target = switches(Path(mutants)), Path(out)
    if not target.exists() or target.read_text(encoding="utf-8") != text:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:])
