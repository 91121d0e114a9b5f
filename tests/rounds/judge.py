"""Judge a blind round's defects, one at a time, against this checkout's build: apply the defect's
line to the prepared fork tree (or retro's own file), rebuild incrementally, certify its clause on
cpu and rpc without seeded defects, and append the verdict to the round's verdicts.txt the moment
it is made (a round stopped anywhere goes on from that file: a judged defect is not judged again).

    python tests/rounds/judge.py tests/rounds/2026-12-07-TOPO-06 --clause TOPO-06

A defect that names its own `clause` is judged against it; --clause is the round's default.

A defect's `original` is as the reviewer's release view showed it (tests/rounds/release_view.py):
where the view read `false` (`False`) for a seeded-defect switch and dropped its comment, the line
it stands for is found by that pattern.
Each clause is first certified intact (a check that fails intact would catch everything); then a
defect's verdict (`verdict`) compares its cases with those intact outcomes, and names the commit
that judged it."""

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


def outcomes(clause: str) -> dict[str, tuple[str, str]] | str:
    """Each intact case of the clause on cpu and rpc: (outcome, message) by node id; or why the
    harness could not judge."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = ["retro-conformance", "certify", "--backend", "cpu,rpc", "--clauses", clause, "--no-defects"]
        run = subprocess.run([*cmd, "-j", "2", "--out", str(out)], capture_output=True, text=True)
        if not (out / "results.json").exists():
            return f"the harness failed (exit {run.returncode}): {run.stderr.strip()[-300:]}"
        res = json.loads((out / "results.json").read_text(encoding="utf-8"))
    absent = [n for n, b in res["backends"].items() if b["status"] != "available"]
    if absent:
        return f"backend(s) not available: {', '.join(absent)}"
    runs = [c for c in res["cases"] if clause in c["clauses"] and c["defect"] is None]
    return {c["nodeid"]: (c["outcome"], (c["message"] or "").strip()) for c in runs}


def verdict(clause: str, baseline: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """`caught` when a check failed on an assertion bound to the clause; `crash` when one died;
    `unbound` when one failed outside the clause's assertions (another clause's assertion, the
    library's own refusal, a pytest.raises that did not hold: not counted by the rule); `escaped` when every case ended as
    it did intact (a case not supported on a backend stays so, and judges nothing there)."""
    runs = outcomes(clause)
    if isinstance(runs, str):
        return "not judged", runs
    changed = {n: r for n, r in runs.items() if r != baseline.get(n, ("pass", "")) or r[0] == "fail"}
    first = lambda rs: next(iter(rs.values()))[1].splitlines()[0][:300] if rs else ""  # noqa: E731
    bound = {n: r for n, r in changed.items() if r[0] == "fail" and f"{clause}:" in r[1]}
    for name, kind in (("caught", bound), ("crash", {n: r for n, r in changed.items() if r[0] == "crash"})):
        if kind:
            return name, first(kind) or "the interpreter died"
    failed = {n: r for n, r in changed.items() if r[0] == "fail"}
    if failed:
        return "unbound", first(failed)
    if changed:  # a case passed intact and now is not supported or expected to fail: nothing judged
        return "not judged", f"{next(iter(changed.values()))[0]}: {first(changed)}"
    return "escaped", "every check of the clause passed"


def baseline_of(clause: str | None, cache: dict[str, dict]) -> dict[str, tuple[str, str]]:
    """The clause's intact outcomes at this checkout, once per run of the judge: a round is judged
    only against checks that pass intact (a failing one would catch every defect)."""
    if clause is None:
        raise SystemExit("a defect names no clause and the round gave none (--clause)")
    if clause not in cache:
        runs = outcomes(clause)
        if isinstance(runs, str) or any(o in ("fail", "crash") for o, _ in runs.values()):
            raise SystemExit(f"{clause} does not pass intact here: {runs}")
        cache[clause] = runs
    return cache[clause]


LEDGER = REPO / "conformance" / "reviewed_defects.toml"


def _toml(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string or list of strings is a TOML one


def record(round_dir: Path, name: str, clause: str | None) -> int:
    """Append each judged defect of the round to the ledger (conformance/reviewed_defects.toml) at
    its first judgment: `caught` by its own clause, or an escape with what it is still open for
    (an escape answered later gets `caught_since` in place of `still_open`, by hand, once a
    re-judgment in the round's rejudged.txt shows it). An invalid defect (it did not compile) or
    one not judged is no reviewer's defect of the ledger; one already there is left as it is."""
    defects = tomllib.loads((round_dir / "defects.toml").read_text(encoding="utf-8"))["defect"]
    lines = (round_dir / "verdicts.txt").read_text(encoding="utf-8").splitlines()
    first = {}
    for ln in lines:  # the first verdict of each defect that judged something
        did, rest = ln.split(" ", 1)
        judged, _, why = rest.partition(": ")
        outcome, _, at = judged.partition(" at ")
        if outcome not in ("not judged",) and did not in first:
            first[did] = (outcome, at, why)
    known = {d["id"] for d in tomllib.loads(LEDGER.read_text(encoding="utf-8"))["defect"]}
    out = []
    for d in defects:
        if d["id"] in known or d["id"] not in first or first[d["id"]][0] in ("invalid", "not applied"):
            continue
        outcome, at, why = first[d["id"]]
        own = d.get("clause") or clause
        entry = {
            "id": d["id"],
            "clause": own,
            "round": f"{name} ({round_dir.relative_to(REPO)})",
            "judged_at": at,
            "file": d["file"],
            "original": d["original"],
            "mutated": d["mutated"],
            "why": d["why"],
            "first_judgment": "caught" if outcome == "caught" else "escaped",
        }
        body = "\n".join(f"{k} = {_toml(v)}" for k, v in entry.items())
        other = re.search(r"ClauseViolation: ([A-Z]+(?:-[A-Z]+)?-\d+[a-z]?):", why) if outcome == "unbound" else None
        if outcome == "caught":
            body += f"\ncaught_by = {_toml([own])}"
        elif other and other.group(1) != own:  # caught, by another clause's assertion: not counted
            body = body.replace('first_judgment = "escaped"', 'first_judgment = "caught"')
            body += f"\ncaught_by = {_toml([other.group(1)])}"
        else:
            said = {
                "escaped": "every check of the clause passed",
                "unbound": "a check failed outside the clause's assertions",
                "crash": "the check's interpreter died",
            }[outcome]
            text = said if why == said else f"{said}: {why}"
            body += f"\ncaught_by = []\nstill_open = {_toml(text[:400])}"
        out.append(f"\n[[defect]]\n{body}\n")
    with LEDGER.open("a", encoding="utf-8") as f:
        f.write("".join(out))
    print(f"{len(out)} defects recorded in {LEDGER.relative_to(REPO)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("round", type=Path)
    ap.add_argument("--clause", default=None, help="the clause of defects that name none")
    ap.add_argument("--record", metavar="NAME", help="append the round's first judgments to the ledger, as round NAME")
    ap.add_argument(
        "--rejudge",
        metavar="IDS",
        help="judge these defects again (comma-separated) into rejudged.txt: a new draw, never a first judgment",
    )
    args = ap.parse_args()
    if args.record:
        return record(args.round.resolve(), args.record, args.clause)
    defects = tomllib.loads((args.round / "defects.toml").read_text(encoding="utf-8"))["defect"]
    verdicts = args.round / ("rejudged.txt" if args.rejudge else "verdicts.txt")
    lines = verdicts.read_text(encoding="utf-8").splitlines() if verdicts.exists() else []
    if args.rejudge:
        wanted = set(args.rejudge.split(","))
        defects = [d for d in defects if d["id"] in wanted]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    # a re-judgment is a draw at a commit: one made at an earlier commit is no reason not to draw again
    drawn = [ln for ln in lines if not args.rejudge or f" at {head.strip()}:" in ln]
    done = {ln.split()[0] for ln in drawn if not ln.split(" at ")[0].endswith("not judged")}
    todo = [d for d in defects if d["id"] not in done]
    try:
        judge_each(todo, args.clause, verdicts, head.strip())
    finally:
        if any(not d["file"].endswith(".py") for d in todo):
            rebuild()  # the sources are restored: the build is too
    return 0


def judge_each(defects: list[dict], clause: str | None, verdicts: Path, head: str) -> None:
    baselines: dict[str, dict] = {}
    for d in defects:  # every clause's intact outcomes first, on the intact sources
        baseline_of(d.get("clause") or clause, baselines)
    for d in defects:
        rel = d["file"].removeprefix("llama.cpp/")
        path = FORK / rel if d["file"].startswith("llama.cpp/") else REPO / rel
        text = path.read_text(encoding="utf-8")
        # a defect written on a line changed since the view names how it applies to the line now
        original, mutated = d.get("applied_original", d["original"]), d.get("applied_mutated", d["mutated"])
        try:
            line = locate(text, original)
        except ValueError as err:
            judged, why = "not applied", str(err)
        else:
            lines = text.split("\n")
            lines[lines.index(line)] = mutated  # the whole line, never a part of a longer one
            path.write_text("\n".join(lines), encoding="utf-8")
            try:
                if path.suffix != ".py":  # the editable install reads Python sources where they are
                    rebuild()
                clause_of = d.get("clause") or clause or ""
                judged, why = verdict(clause_of, baselines[clause_of])
            except subprocess.CalledProcessError as err:
                judged, why = "invalid", f"the build failed ({err.returncode})"
            finally:
                path.write_text(text, encoding="utf-8")
        with verdicts.open("a", encoding="utf-8") as f:
            f.write(f"{d['id']} {judged} at {head}: {why}\n")
        print(d["id"], judged, why, flush=True)


if __name__ == "__main__":
    sys.exit(main())
