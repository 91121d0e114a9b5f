"""Independent mutation score of the certification: mutate retro's native loop and the code the
patch series adds to llama.cpp with an off-the-shelf tool (universalmutator), rebuild each mutant
incrementally, certify the covered clauses against it, and report the mutants the certification
let through.

    python tests/mutation/run.py                 # the full sample (see --sample), figures to README
    python tests/mutation/run.py --sample 3 --no-defect-proof   # what CI runs: a small fixed sample

A mutant is killed when a check of the certification fails, crashes or hangs against it (the checks'
intact runs; their seeded-defect runs are proven once, on the unmutated build); it survives when
every check passes; a mutant that does not compile is
invalid and not counted. Known-equivalent mutants (tests/mutation/equivalent.toml, each with its
reason) are reported apart and not counted. The seeded-defect switches, and the branches only they
open, are never mutated: they are off in a certification's intact runs.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from site_view import site_view_env  # noqa: E402

# mutants are written into a copy of the tracked files, never into the working tree
SOURCE = REPO / "build" / "mutation-src"
BUILD = REPO / "build" / "mutation"
PREPARED = BUILD / "llama.cpp"  # the patched llama.cpp tree of this build folder
sys.path.append(str(REPO))  # after the installed packages: `retro` must stay the built one
from conformance import registry  # noqa: E402 - the registry is plain data and stdlib code

# the clauses whose checks run the binding: a mutant of the native code can only be killed there
# (the harness's own clauses certify canaries and known packages)
COVERED = ",".join(cid for cid, c in registry.clauses().items() if c.subject == "binding")
# the CPU, and the RPC backend: a second device is where the placement of state and work matters
BACKENDS = "cpu,rpc"
# retro's own loop and tensor transactions, and the files of the fork whose patched lines are mutated
OWN = [
    "native/core/epoch.cpp",
    "native/core/row_plan.cpp",
    "native/core/trainer.cpp",
    "native/core/callback_scope.cpp",
    "native/core/errors.cpp",
    "native/core/tensor_io.cpp",
    "native/core/transactions.cpp",
    "native/core/decoding.cpp",
]
FORK = ["ggml/src/ggml-opt.cpp", "src/llama-context.cpp"]
# functions no certification can kill a mutant of: the preflight's measurement (no clause covers
# it; tests/test_preflight.py holds it against the real allocation), and the probes the checks
# observe through (a blinded probe shows only in the seeded-defect runs, which mutants skip)
UNCONTRACTED = {
    "ggml/src/ggml-opt.cpp": (
        "ggml_opt_measure",
        "ggml_opt_unbacked_base",
        "ggml_opt_unbacked_buffer",
        "ggml_opt_alloc_ctx",
        "ggml_opt_kept_foreign_sources",
        "ggml_opt_kept_stale_addresses",
        "ggml_opt_kept",
    ),
    "src/llama-context.cpp": (
        # upstream's loop stopping at a failed step (patch 0047): the oracle's own failure report,
        # which tests/test_fault_injection.py holds; no clause drives upstream's loop into a failure
        "llama_context::opt_epoch_stop",
        "llama_opt_epoch_status",
        "llama_context::opt_preflight",
        "llama_opt_preflight",
        "llama_context::opt_topology_walk",
        "llama_opt_topology_foreign_sources",
        "llama_opt_topology_stale_addresses",
    ),
}
# (opt_epoch_stop: the status upstream's loop reports where it stopped, see UNCONTRACTED)
SKIP = re.compile(r"retro_defect_on|RETRO_DEFECT|defect\(|LLAMA_LOG|^\s*//|^\s*#|throw |static_assert|opt_epoch_stop\(")
# an if (or else if) whose body is a block: its condition, up to the block's opening brace
BLOCK_IF = re.compile(r"^\s*(?:\}\s*else\s+)?if\s*\((?P<cond>.*)\)\s*\{\s*(?://.*)?$")
SWITCH = re.compile(r"^\(*\s*(?:retro_defect_on|defect)\(")


def defect_bodies(text: list[str]) -> set[int]:
    """1-based lines inside the blocks of branches taken only with a seeded-defect switch on (a
    condition of &&-joined terms, one of them a switch, not negated): they never run in a
    certification's intact runs, so a mutant there is equivalent by construction."""
    inside: set[int] = set()
    depth = 0  # braces open inside a defect branch's block, its own included
    for n, line in enumerate(text, start=1):
        if depth > 0:
            for ch in line:
                depth += (ch == "{") - (ch == "}")
                if depth == 0:
                    break  # the block closed on this line (a "} else {" starts another branch)
            else:
                inside.add(n)
                continue
        m = BLOCK_IF.match(line)
        if m and "||" not in m["cond"] and any(SWITCH.match(t.strip()) for t in m["cond"].split("&&")):
            depth = 1
    return inside


def function_bodies(text: list[str], names: tuple[str, ...]) -> set[int]:
    """1-based lines of the definitions of the named functions (a definition starts at column 0
    and ends at the next closing brace there)."""
    inside: set[int] = set()
    start = re.compile(r"^[A-Za-z].*\b(?:" + "|".join(map(re.escape, names)) + r")\(") if names else None
    open_at = 0
    for n, line in enumerate(text, start=1):
        if open_at:
            inside.add(n)
            if line.startswith("}"):
                open_at = 0
        elif start and start.match(line) and not line.rstrip().endswith(";"):
            open_at = n
            inside.add(n)
    return inside


@dataclass
class Mutant:
    file: str  # repo-relative, or llama.cpp/<path> for the fork
    line: int
    original: str
    mutated: str
    path: str  # the mutant file universalmutator wrote
    outcome: str = ""  # killed | survived | invalid | equivalent
    seconds: float = 0.0
    detail: str = ""


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def site_env(site: Path) -> dict[str, str]:
    """An environment whose interpreter (run with -S) sees the mutant build, not an editable install."""
    # one ggml thread: a certification stays as fast with other work on the machine (see retro.bench)
    return {**site_view_env(site, site.parent / "site-view"), "RETRO_THREADS": "1"}


def sync_source() -> None:
    """SOURCE holds the tracked files as the working tree has them; unchanged files keep their
    times, so the build stays incremental."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src, dst = REPO / name, SOURCE / name
        if src.is_file() and (not dst.exists() or dst.read_bytes() != src.read_bytes()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def build(site: Path) -> subprocess.CompletedProcess[str]:
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--disable-pip-version-check"]
    return sh([*pip, "--upgrade", "--target", str(site), f"-Cbuild-dir={BUILD}", str(SOURCE)])


#: the address space a certification may take: a mutant that allocates without end (a loop
#: counting the wrong way, pushing rows) gets bad_alloc, a failed check, instead of the machine's memory
ADDRESS_SPACE = 12 << 30


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def certify(site: Path, out: Path, timeout: float, *, defects: bool) -> tuple[int, list[str]]:
    """The exit code, and the clauses whose checks failed or crashed. A mutant's run (defects
    off) stops at its first failure: one is enough to kill it."""
    cmd = [
        sys.executable,
        "-S",
        "-m",
        "retro.conformance.cli",
        "certify",
        "--backend",
        BACKENDS,
        "--clauses",
        COVERED,
        "--out",
        str(out),
        "--case-timeout",
        str(timeout),
        # a clause whose implemented part passes still measures: its checks run and must kill mutants
        "--gate",
        "covered",
    ]
    mode = [] if defects else ["--no-defects", "--exitfirst"]
    run = sh([*cmd, *mode], env=site_env(site), cwd=out.parent, preexec_fn=_cap_memory)
    results = out / "results.json"
    if not results.exists():
        return run.returncode, ["(no results)"]
    cases = json.loads(results.read_text(encoding="utf-8"))["cases"]
    return run.returncode, sorted({c for r in cases if r["outcome"] in ("fail", "crash") for c in r["clauses"]})


def patched_lines(rel: str) -> list[int]:
    """Line numbers, in the patched file, of the lines the patch series added to it."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "llama"
        empty = Path(tmp) / "none"
        empty.mkdir()
        prep = [
            sys.executable,
            str(SOURCE / "vendor" / "prepare_llama_cpp.py"),
            "--dest",
            str(tree),
            "--patches",
            str(empty),
            "--backends",
            "cpu",
            "--info",
            str(Path(tmp) / "info.json"),
        ]
        subprocess.run(prep, check=True, capture_output=True)
        pristine = (tree / rel).read_text(encoding="utf-8").splitlines(keepends=True)
        (Path(tmp) / "a").write_text("".join(pristine), encoding="utf-8")
        diff = sh(["diff", "-U0", str(Path(tmp) / "a"), str(PREPARED / rel)]).stdout
    added: list[int] = []
    for m in re.finditer(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", diff, re.M):
        start, count = int(m[1]), int(m[2] or 1)
        added += range(start, start + count)
    return added


def generate(source: Path, rel: str, lines: list[int] | None, workdir: Path) -> list[Mutant]:
    text = source.read_text(encoding="utf-8").splitlines()
    not_mutated = defect_bodies(text) | function_bodies(text, UNCONTRACTED.get(rel.removeprefix("llama.cpp/"), ()))
    keep = [
        n
        for n in (lines or range(1, len(text) + 1))
        if n <= len(text) and text[n - 1].strip() and not SKIP.search(text[n - 1]) and n not in not_mutated
    ]
    out = workdir / re.sub(r"\W", "_", rel)
    out.mkdir(parents=True, exist_ok=True)
    lines_file = out / "lines.txt"
    lines_file.write_text("\n".join(map(str, keep)), encoding="utf-8")
    sh(["mutate", str(source), "cpp", "--noCheck", "--mutantDir", str(out), "--lines", str(lines_file)])
    mutants = []
    for path in sorted(out.glob("*.mutant.*")):
        mutated = path.read_text(encoding="utf-8").splitlines()
        changed = [i for i, (a, b) in enumerate(zip(text, mutated)) if a != b]
        if len(mutated) == len(text) and len(changed) == 1:
            i = changed[0]
            mutants.append(Mutant(rel, i + 1, text[i].strip(), mutated[i].strip(), str(path)))
    return mutants


def equivalents() -> list[dict]:
    path = Path(__file__).with_name("equivalent.toml")
    return tomllib.loads(path.read_text(encoding="utf-8")).get("equivalent", []) if path.exists() else []


def known_equivalent(m: Mutant, known: list[dict]) -> str | None:
    """The reason a mutant is equivalent: an entry naming it, or a class of entries (``kind``)."""
    for e in known:
        if e.get("kind") == "counting-loop-bound":
            # `for (...; i < n; ++i)` with i counting up by one from below n stops at n either way
            loop = re.match(r"for \((.*); (\w+) < ([^;]+); \+\+\2\) \{$", m.original)
            if loop and m.mutated == m.original.replace(f"; {loop[2]} < ", f"; {loop[2]} != ", 1):
                return e["reason"]
        elif e.get("kind") == "seeded-defect-arm":
            if any(_within(m, arm) for flag in e["flags"] for arm in _defect_arms(m.original, flag)):
                return e["reason"]
        elif e.get("file") == m.file and e.get("original") == m.original and e.get("mutated") == m.mutated:
            return e["reason"]
    return None


def _defect_arms(line: str, flag: str) -> list[tuple[int, int]]:
    """The spans of `flag ? arm : ...` in a line: the arm a seeded-defect flag alone selects."""
    arms = []
    for m in re.finditer(rf"\b{re.escape(flag)} \? ", line):
        depth, end = 0, None
        for i in range(m.end(), len(line)):
            depth += (line[i] in "([") - (line[i] in ")]")
            if depth < 0 or (depth == 0 and line.startswith(" : ", i)):
                end = i
                break
        if end is not None and depth == 0:
            arms.append((m.end(), end))
    return arms


def _within(m: Mutant, span: tuple[int, int]) -> bool:
    """Whether every character the mutant changed lies inside span of the original line."""
    a, b = m.original, m.mutated
    head = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    tail = 0
    while tail < min(len(a), len(b)) - head and a[len(a) - 1 - tail] == b[len(b) - 1 - tail]:
        tail += 1
    return span[0] <= head and len(a) - tail <= span[1]


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")  # unwinds through the finally that restores a mutated file


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sample", type=int, default=60, help="mutants to run, drawn with --seed from all generated")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--case-timeout", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=REPO / "build" / "mutation-results.json")
    ap.add_argument("--only", action="append", default=None, help="draw mutants from this file only (repeatable)")
    ap.add_argument(
        "--no-defect-proof",
        action="store_true",
        help="certify the unmutated build without its seeded-defect runs, where another run proves them "
        "(the test suite's full certification does)",
    )
    ap.add_argument("--rescore", action="store_true", help="re-triage the survivors of --out against equivalent.toml")
    args = ap.parse_args(argv)
    if args.rescore:
        saved = json.loads(args.out.read_text(encoding="utf-8"))
        sample = [Mutant(**m) for m in saved["mutants"]]
        for m in sample:
            reason = known_equivalent(m, equivalents()) if m.outcome == "survived" else None
            if reason:
                m.outcome, m.detail = "equivalent", reason
        return report(sample, saved["generated"], saved["seed"], args.out)

    with tempfile.TemporaryDirectory(prefix="retro-mutation-") as tmp:
        work = Path(tmp)
        site = work / "site"
        sync_source()
        # the patched tree is prepared afresh: a run that was killed may have left a mutant in it
        (PREPARED / ".retro-stamp.json").unlink(missing_ok=True)
        first = build(site)  # the unmutated build, which also prepares the patched tree
        if first.returncode != 0:
            print(first.stdout[-3000:] + first.stderr[-3000:], file=sys.stderr)
            return 2
        (work / "baseline").mkdir()
        rc, failed = certify(site, work / "baseline" / "out", args.case_timeout, defects=not args.no_defect_proof)
        # without its defect runs no clause can pass the gate: then no check may fail
        if failed or (rc != 0 and not args.no_defect_proof):
            print("the unmutated build is not certified: nothing to measure", file=sys.stderr)
            return 2
        mutants: list[Mutant] = []
        for rel in OWN:
            mutants += generate(SOURCE / rel, rel, None, work / "mutants")
        for rel in FORK:
            mutants += generate(PREPARED / rel, f"llama.cpp/{rel}", patched_lines(rel), work / "mutants")
        if args.only:
            mutants = [m for m in mutants if m.file in args.only]
        generated = len(mutants)
        random.Random(args.seed).shuffle(mutants)
        sample = sorted(mutants[: args.sample], key=lambda m: (m.file, m.line))
        known = equivalents()
        print(f"{generated} mutants generated; running {len(sample)}", flush=True)
        for n, m in enumerate(sample, 1):
            reason = known_equivalent(m, known)
            if reason:
                m.outcome, m.detail = "equivalent", reason
                print(f"[{n}/{len(sample)}] {m.file}:{m.line} equivalent ({reason})", flush=True)
                continue
            target = (
                SOURCE / m.file if not m.file.startswith("llama.cpp/") else PREPARED / m.file.removeprefix("llama.cpp/")
            )
            original = target.read_bytes()
            t0 = time.monotonic()
            try:
                shutil.copyfile(m.path, target)
                built = build(site)
                if built.returncode != 0:
                    m.outcome, m.detail = "invalid", "does not compile"
                else:
                    (work / f"m{n}").mkdir()
                    # the checks' intact runs judge a mutant; their defect runs were proven on the baseline
                    _, failed = certify(site, work / f"m{n}" / "out", args.case_timeout, defects=False)
                    m.outcome = "killed" if failed else "survived"
                    m.detail = "failed: " + ", ".join(failed) if failed else ""
            finally:
                target.write_bytes(original)
            m.seconds = round(time.monotonic() - t0, 1)
            print(
                f"[{n}/{len(sample)}] {m.file}:{m.line} {m.outcome} ({m.seconds} s): {m.original!r} -> {m.mutated!r}"
                + (f" [{m.detail}]" if m.detail else ""),
                flush=True,
            )
        build(site)  # leave the build folder as the sources are

    return report(sample, generated, args.seed, args.out)


def report(sample: list[Mutant], generated: int, seed: int, out: Path) -> int:
    counted = [m for m in sample if m.outcome in ("killed", "survived")]
    killed = sum(m.outcome == "killed" for m in counted)
    score = 100.0 * killed / len(counted) if counted else 0.0
    summary = {
        "generated": generated,
        "sampled": len(sample),
        "seed": seed,
        "killed": killed,
        "survived": len(counted) - killed,
        "invalid": sum(m.outcome == "invalid" for m in sample),
        "equivalent": sum(m.outcome == "equivalent" for m in sample),
        "score_percent": round(score, 1),
        "mutants": [asdict(m) for m in sample],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(
        f"mutation score: {score:.1f} % ({killed} of {len(counted)} non-equivalent, compiling mutants killed; "
        f"{summary['invalid']} invalid, {summary['equivalent']} equivalent); results in {out}"
    )
    for m in sample:
        if m.outcome == "survived":
            print(f"  survived: {m.file}:{m.line}: {m.original!r} -> {m.mutated!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
