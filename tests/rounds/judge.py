"""Judge a blind round's defects, one at a time, against this checkout's build: apply the defect's
line to the prepared fork tree (or retro's own file), rebuild incrementally, certify its clause on
cpu and rpc without seeded defects, and append the verdict to the round's verdicts.txt the moment
it is made (a round stopped anywhere goes on from that file: a judged defect is not judged again).

    python tests/rounds/judge.py tests/rounds/2026-12-07-TOPO-06 --clause TOPO-06

A defect that names its own `clause` is judged against it; --clause is the round's default.

A defect's `original` is as the reviewer's release view showed it (tests/rounds/release_view.py):
where the view read `false` (`False`) for a seeded-defect switch and dropped its comment, the line
it stands for is found by that pattern.
The verdict is `caught` when a check of the clause failed on an assertion bound to the clause,
`crash` when one died, `escaped` when the clause passed, each with the commit that judged it."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from release_view import NATIVE_SWITCH, PYTHON_SWITCH

REPO = Path(__file__).resolve().parents[2]
FORK = REPO / "build" / "dev" / "llama.cpp"


def locate(text: str, original: str) -> str:
    """The line of `text` that the view's `original` stands for (exactly one)."""
    lines = text.splitlines()
    hits = [ln for ln in lines if ln == original]
    if not hits:
        pattern = re.escape(original.rstrip()).replace("false", f"(?:false|{NATIVE_SWITCH.pattern})")
        pattern = pattern.replace("False", f"(?:False|{PYTHON_SWITCH.pattern})")
        hits = [ln for ln in lines if re.fullmatch(pattern + r"\s*((//|#).*)?", ln)]
    if len(hits) != 1:
        raise ValueError(f"{len(hits)} lines stand for {original!r}")
    return hits[0]


def rebuild() -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps"]
    subprocess.run([*cmd, "-Cbuild-dir=build/dev", "-e", "."], cwd=REPO, check=True)


def certify(clause: str) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = ["retro-conformance", "certify", "--backend", "cpu,rpc", "--clauses", clause, "--no-defects"]
        run = subprocess.run([*cmd, "-j", "2", "--out", str(out)], capture_output=True, text=True)
        if not (out / "results.json").exists():
            return "not judged", f"the harness failed (exit {run.returncode}): {run.stderr.strip()[-300:]}"
        res = json.loads((out / "results.json").read_text(encoding="utf-8"))
    absent = [n for n, b in res["backends"].items() if b["status"] != "available"]
    if absent:
        return "not judged", f"backend(s) not available: {', '.join(absent)}"
    runs = [c for c in res["cases"] if clause in c["clauses"] and c["defect"] is None]
    bound = [c for c in runs if c["outcome"] == "fail" and f"{clause}:" in (c["message"] or "")]
    if bound:
        return "caught", bound[0]["message"].strip().splitlines()[0][:300]
    crashed = [c for c in runs if c["outcome"] == "crash"]
    if crashed:
        return "crash", (crashed[0]["message"] or "").strip().splitlines()[0][:300]
    other = [c for c in runs if c["outcome"] != "pass"]
    if other:  # not supported, an expected failure: nothing was judged there
        return "not judged", f"{other[0]['outcome']}: {(other[0]['message'] or '').strip()[:300]}"
    return "escaped", "every check of the clause passed"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("round", type=Path)
    ap.add_argument("--clause", default=None, help="the clause of defects that name none")
    args = ap.parse_args()
    defects = tomllib.loads((args.round / "defects.toml").read_text(encoding="utf-8"))["defect"]
    verdicts = args.round / "verdicts.txt"
    lines = verdicts.read_text(encoding="utf-8").splitlines() if verdicts.exists() else []
    done = {ln.split()[0] for ln in lines if not ln.split(" at ")[0].endswith("not judged")}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    todo = [d for d in defects if d["id"] not in done]
    try:
        judge_each(todo, args.clause, verdicts, head.strip())
    finally:
        if any(not d["file"].endswith(".py") for d in todo):
            rebuild()  # the sources are restored: the build is too
    return 0


def judge_each(defects: list[dict], clause: str | None, verdicts: Path, head: str) -> None:
    for d in defects:
        rel = d["file"].removeprefix("llama.cpp/")
        path = FORK / rel if d["file"].startswith("llama.cpp/") else REPO / rel
        text = path.read_text(encoding="utf-8")
        # a defect written on a line changed since the view names how it applies to the line now
        original, mutated = d.get("applied_original", d["original"]), d.get("applied_mutated", d["mutated"])
        try:
            line = locate(text, original)
        except ValueError as err:
            verdict, why = "not applied", str(err)
        else:
            lines = text.split("\n")
            lines[lines.index(line)] = mutated  # the whole line, never a part of a longer one
            path.write_text("\n".join(lines), encoding="utf-8")
            try:
                if path.suffix != ".py":  # the editable install reads Python sources where they are
                    rebuild()
                verdict, why = certify(d.get("clause") or clause)
            except subprocess.CalledProcessError as err:
                verdict, why = "invalid", f"the build failed ({err.returncode})"
            finally:
                path.write_text(text, encoding="utf-8")
        with verdicts.open("a", encoding="utf-8") as f:
            f.write(f"{d['id']} {verdict} at {head}: {why}\n")
        print(d["id"], verdict, why, flush=True)


if __name__ == "__main__":
    sys.exit(main())
