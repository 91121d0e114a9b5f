"""Independent mutation score of the certification: mutate the Python API (retro/*.py), retro's
native core (the loop, tensor transactions, the RPC link, the thread governor) and the lines the
patch series adds to llama.cpp with an off-the-shelf tool (universalmutator), error-raising lines
included; rebuild each mutant (or, for Python, put the mutated module in place), judge it by the
whole certification, and report the mutants it let through.

    python tests/mutation/run.py --sample 80 --seed 2026 --out F   # a scored sample, figures to docs/evidence.md
    python tests/mutation/run.py --resume --out F                  # go on with a run that stopped
    python tests/mutation/run.py --pinned tests/mutation/pinned.toml --no-defect-proof   # what CI runs

A mutant is judged by the whole certification (every clause, cpu and rpc). It is *killed* when its
intact run reads otherwise than the unmutated build's intact run (a check fails, crashes or hangs,
or any verdict differs: a backend gone reads "not available"), and reads so again when those
clauses are run once more (a check on a loaded machine can fail by chance); a *weak kill* when the
intact runs all read as the unmutated build's and only a seeded-defect run tells (a defect the
baseline catches escapes, or a defect run crashes): counted apart, not as a kill; it *survives*
when the whole certification reads as on the unmutated build. A mutant that does not compile is
invalid and not counted; the sample is drawn
from the seeded shuffle until --sample mutants have been judged. Known-equivalent mutants
(tests/mutation/equivalent.toml, each with its reason) are reported apart and not counted. The
seeded-defect switches, and the branches only they open, are never mutated: they are off in a
certification's intact runs. Results are written after every mutant; --resume continues a run
(and, with --rejudge, judges its survivors and weak kills again once the checks have changed).
A run drawn from a committed tree records the commit: resumed after the sources changed, it draws
the same mutants from that commit's files and puts each onto today's file at its line, where the
file around it is unchanged; a mutant whose line itself changed is *stale*, drawn past and not
counted (the fork's patch series must be unchanged, and so must what this file keeps from the draw).

--pinned judges the mutants a file names instead of a draw: each is put onto today's source at the
line that reads as its original, nearest the line it names. CI judges three so, one in each room a
mutant is put in place differently (a Python module swapped, the native core rebuilt, the patched
fork rebuilt): a draw would change with every edit of the sources, and a CI whose verdict turns on
which mutants an unrelated edit happens to draw says nothing.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
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
# universalmutator's command, installed beside this interpreter (a venv's bin need not be on PATH)
MUTATE = shutil.which("mutate") or str(Path(sys.executable).with_name("mutate"))
sys.path.append(str(REPO))  # after the installed packages: `retro` must stay the built one
from conformance import outcomes, registry  # noqa: E402 - the registry and the outcome names

# the whole certification judges every mutant
COVERED = ",".join(registry.clauses())
# the CPU, and the RPC backend: a second device is where the placement of state and work matters
BACKENDS = "cpu,rpc"
# retro's native core and its bindings, whole, but for what the checks judge through: the graph
# probe (the checks read nodes and devices through it), the upstream loop's oracle
# (upstream_oracle.cpp), the preflight's measurement (no clause governs it; tests/test_preflight.py
# holds it against the real allocation) and the test-hook door (bind_hooks.cpp: the switches and
# fault sites the judge sets)
OWN = [
    "native/core/epoch.cpp",
    "native/core/row_plan.cpp",
    "native/core/trainer.cpp",
    "native/core/callback_scope.cpp",
    "native/core/errors.cpp",
    "native/core/tensor_io.cpp",
    "native/core/transactions.cpp",
    "native/core/decoding.cpp",
    "native/core/remote.cpp",
    "native/core/thread_governor.cpp",
    "native/core/context_calls.cpp",
    "native/core/logging.cpp",
    "native/core/handles.h",
    "native/core/call_guard.h",
    "native/bindings/module.cpp",
    "native/bindings/bind_context.cpp",
    "native/bindings/bind_errors.cpp",
    "native/bindings/bind_model.cpp",
    "native/bindings/bind_runtime.cpp",
    "native/bindings/bind_trainer.cpp",
    "native/bindings/bind_transactions.cpp",
]
# the Python API; not the benchmarks, the build's stub writer, or retro.testing (the oracles and
# probes the checks observe through: mutating them mutates the judge), nor retro.scoring (teacher
# forcing and a teacher's top-k: no clause governs them, tests/test_scoring.py holds them against
# numpy; TOPO-05's scoring event is the decode scoring makes, which the checks drive directly)
NOT_DRAWN = ("bench.py", "_stubgen.py", "scoring.py")
#: Python functions no clause governs, by module: generation's sampling options (temperature and
#: seed; tests/test_transactions.py holds their bounds exactly)
PY_UNCONTRACTED = {"retro/context.py": ("_sampling",)}
PYTHON = sorted(str(p.relative_to(REPO)) for p in (REPO / "retro").glob("*.py") if p.name not in NOT_DRAWN)
# the files of the fork whose patched lines are mutated (upstream's own lines are not ours): the
# optimizer and the training loop, the RPC link, and the CPU's cross-entropy kernels (patches
# 0023, 0025 and 0031; the other backends' kernels are judged on their own machines)
FORK = [
    "ggml/src/ggml-opt.cpp",
    "src/llama-context.cpp",
    "ggml/src/ggml-rpc/ggml-rpc.cpp",
    "ggml/src/ggml-rpc/transport.cpp",
    "ggml/src/ggml-cpu/ops.cpp",
]
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
# (log lines are drawn: the diagnostics FAIL-01 and TX-FAIL-01 carry are read from them)
SKIP = re.compile(r"RETRO_DEFECT_|^\s*//|^\s*#|static_assert|opt_epoch_stop\(")
# Python: comments, the seeded-defect switches, and lines that only name types
PY_SKIP = re.compile(r"^\s*#|seeded\(|^\s*(?:from|import) |TYPE_CHECKING|^\s*@overload")
# an if (or else if) whose body is a block: its condition, up to the block's opening brace
BLOCK_IF = re.compile(r"^\s*(?:\}\s*else\s+)?if\s*\((?P<cond>.*)\)\s*\{\s*(?://.*)?$")
# a seeded-defect switch, whatever reads it (retro_defect_on in the fork, a snapshot in the core): a
# call whose argument is one of the switches' constants, the one form every native switch shares
SWITCH = re.compile(r"^\(*\s*[\w.>-]+\(RETRO_DEFECT_\w+\)")


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


def python_not_mutated(source: str, uncontracted: tuple[str, ...] = ()) -> set[int]:
    """1-based lines of a Python module no mutant may change: docstrings (and other bare strings),
    the bodies of branches a seeded-defect switch alone opens, annotations without a value, and the
    named functions no clause governs (their definitions whole)."""
    inside: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        bare_string = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if (bare_string and isinstance(node.value.value, str)) or (isinstance(node, ast.AnnAssign) and not node.value):
            inside.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.FunctionDef) and node.name in uncontracted:
            inside.update(range(min([node.lineno, *(d.lineno for d in node.decorator_list)]), node.end_lineno + 1))
        elif isinstance(node, ast.If) and _is_switch(node.test):
            for stmt in node.body:
                inside.update(range(stmt.lineno, stmt.end_lineno + 1))
    return inside


def _is_switch(test: ast.expr) -> bool:
    terms = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    return any(
        isinstance(t, ast.Call) and getattr(t.func, "attr", getattr(t.func, "id", None)) == "seeded" for t in terms
    )


@dataclass
class Mutant:
    file: str  # repo-relative, or llama.cpp/<path> for the fork
    line: int
    original: str
    mutated: str
    path: str  # the mutant file universalmutator wrote
    outcome: str = ""  # killed | weak | survived | invalid | equivalent | stale (its line changed since the draw)
    seconds: float = 0.0
    detail: str = ""
    checks: str = ""  # the commit whose checks judged it ("": a working tree's edits)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def site_env(site: Path) -> dict[str, str]:
    """An environment whose interpreter (run with -S) sees the mutant build, not an editable install."""
    # one ggml thread: a certification stays as fast with other work on the machine (see retro.bench)
    return {**site_view_env(site, site.parent / "site-view"), "RETRO_THREADS": "1"}


def sync_source() -> None:
    """SOURCE holds the tracked files as the working tree has them; unchanged files keep their
    times, so the build stays incremental, and a changed one is written now: with the working
    tree's time it could be older than the objects an earlier build made from its old text."""
    SYNCED["drawn"] = _head_if_unedited([*OWN, "retro", "vendor"])
    SYNCED["checks"] = _head_if_unedited([*OWN, "retro", "vendor", "native", "conformance", "fault_injection"])
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (f.decode() for f in files)):
        src, dst = REPO / name, SOURCE / name
        if src.is_file() and (not dst.exists() or dst.read_bytes() != src.read_bytes()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            shutil.copymode(src, dst)


def build(site: Path) -> subprocess.CompletedProcess[str]:
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--disable-pip-version-check"]
    return sh([*pip, "--upgrade", "--target", str(site), f"-Cbuild-dir={BUILD}", str(SOURCE)])


#: the address space a certification may take: a mutant that allocates without end (a loop
#: counting the wrong way, pushing rows) gets bad_alloc, a failed check, instead of the machine's memory
ADDRESS_SPACE = 12 << 30


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@dataclass
class Certification:
    returncode: int
    failed: list[str]  # clauses with a check that failed or crashed
    verdicts: dict[str, str]  # "CLAUSE on backend" -> its status
    first_failure: str = ""  # the first failed check and the head of its message
    partial: frozenset[str] = frozenset()  # "CLAUSE on backend" read partial: passing where implemented


def certify(
    site: Path, out: Path, timeout: float, *, defects: bool, clauses: str = COVERED, keyword: str | None = None
) -> Certification:
    """Certify the clauses (every one by default) against the build in site, by the checks pytest's
    -k `keyword` selects when given. A run without its seeded defects stops at its first failure:
    one is enough to kill a mutant."""
    cmd = [
        sys.executable,
        "-S",
        "-m",
        "retro.conformance.cli",
        "certify",
        "--backend",
        BACKENDS,
        "--clauses",
        clauses,
        "--out",
        str(out),
        "--case-timeout",
        str(timeout),
    ]
    mode = [] if defects else ["--no-defects", "--exitfirst"]
    if keyword:
        mode += ["-k", keyword]
    run = sh([*cmd, *mode], env=site_env(site), cwd=out.parent, preexec_fn=_cap_memory)
    results = out / "results.json"
    if not results.exists():
        return Certification(run.returncode, ["(no results)"], {})
    saved = json.loads(results.read_text(encoding="utf-8"))
    failed = sorted({c for r in saved["cases"] if r["outcome"] in ("fail", "crash") for c in r["clauses"]})
    verdicts = {f"{cid} on {b}": v for cid, per in saved["clauses"].items() for b, v in per.items()}
    partial = frozenset(
        f"{cid} on {b}"
        for cid, per in saved["clause_details"].items()
        for b, why in per.items()
        if why.startswith(outcomes.PARTLY_IMPLEMENTED)
    )
    first = next((r for r in saved["cases"] if r["outcome"] in ("fail", "crash")), None)
    head = f"{first['nodeid'].split('::')[-1]}: {(first.get('message') or '')[:300]}" if first else ""
    return Certification(run.returncode, failed, verdicts, head, partial)


def lost(baseline: Certification, mutant: Certification) -> list[str]:
    """What the baseline's certification passed and the mutant's does not."""
    return sorted(k for k, v in baseline.verdicts.items() if v == "pass" and mutant.verdicts.get(k) != "pass")


def changed(baseline: Certification, mutant: Certification, clauses: list[str] | None = None) -> list[str]:
    """The verdicts (of `clauses` only, for a run of some of them) that differ between two runs
    made alike: an intact run reads "not covered" where a certification with its seeded defects
    would read pass, and a mutant's intact run must read the same."""
    return sorted(
        k
        for k, v in baseline.verdicts.items()
        if mutant.verdicts.get(k) != v and (clauses is None or k.split(" on ")[0] in clauses)
    )


def clauses_of(verdicts: list[str]) -> list[str]:
    """The clauses of "CLAUSE on backend" verdicts."""
    return sorted({k.split(" on ")[0] for k in verdicts})


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
            "cpu,rpc",
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
    code = source.read_text(encoding="utf-8")
    text = code.splitlines()
    python = rel.endswith(".py")
    if python:
        not_mutated, skip = python_not_mutated(code, PY_UNCONTRACTED.get(rel, ())), PY_SKIP
    else:
        not_mutated = defect_bodies(text) | function_bodies(text, UNCONTRACTED.get(rel.removeprefix("llama.cpp/"), ()))
        skip = SKIP
    keep = [
        n
        for n in (lines or range(1, len(text) + 1))
        if n <= len(text) and text[n - 1].strip() and not skip.search(text[n - 1]) and n not in not_mutated
    ]
    out = workdir / re.sub(r"\W", "_", rel)
    out.mkdir(parents=True, exist_ok=True)
    lines_file = out / "lines.txt"
    lines_file.write_text("\n".join(map(str, keep)), encoding="utf-8")
    sh(
        [
            MUTATE,
            str(source),
            "python" if python else "cpp",
            "--noCheck",
            "--mutantDir",
            str(out),
            "--lines",
            str(lines_file),
        ],
        cwd=out,  # where it writes its scratch files
    )
    mutants = []
    for path in sorted(out.glob("*.mutant.*")):
        mutated = path.read_text(encoding="utf-8").splitlines()
        changed = [i for i, (a, b) in enumerate(zip(text, mutated)) if a != b]
        if len(mutated) == len(text) and len(changed) == 1:
            i = changed[0]
            mutants.append(Mutant(rel, i + 1, text[i].strip(), mutated[i].strip(), str(path)))
    return mutants


def where(rel: str) -> Path:
    """The file a mutant of rel is put into: the patched tree for the fork, else the synced sources
    (a Python module's copy there is the installed one's twin, checked before any mutant runs)."""
    return PREPARED / rel.removeprefix("llama.cpp/") if rel.startswith("llama.cpp/") else SOURCE / rel


def onto_today(rel: str, line: int, original: str, mutated: str) -> tuple[list[str], int]:
    """Today's lines of rel with the mutant in place, and its 0-based index: the line whose text
    (indentation aside) is the original, the nearest to `line` when several are."""
    text = where(rel).read_text(encoding="utf-8").splitlines(keepends=True)
    at = [i for i, t in enumerate(text) if t.strip() == original]
    if not at:
        raise SystemExit(f"{rel} has no line {original!r} any more")
    i = min(at, key=lambda i: abs(i + 1 - line))
    text[i] = text[i][: len(text[i]) - len(text[i].lstrip())] + mutated + "\n"
    return text, i


def pinned(spec: Path, workdir: Path) -> list[Mutant]:
    """The mutants spec names, each written onto today's sources (onto_today)."""
    mutants = []
    for n, entry in enumerate(tomllib.loads(spec.read_text(encoding="utf-8"))["mutant"]):
        text, i = onto_today(entry["file"], entry["line"], entry["original"], entry["mutated"])
        path = workdir / "pinned" / f"{n}.{Path(entry['file']).name}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(text), encoding="utf-8")
        mutants.append(Mutant(entry["file"], i + 1, entry["original"], entry["mutated"], str(path)))
    return mutants


def pinned_scope(spec: Path) -> tuple[str, str | None]:
    """The clauses a pinned run certifies, and the -k selection of their checks: those its mutants
    name as having killed them (every clause and check when one names none). CI's pinned run proves
    that the runner puts each mutant in place and judges it, not the score: certifying every clause
    for it would repeat the suite's own run (as Mull and mutmut run a mutant by the tests that reach it)."""
    entries = tomllib.loads(spec.read_text(encoding="utf-8"))["mutant"]
    named = [entry.get("killed_by") for entry in entries]
    if not all(named):
        return COVERED, None
    checks = [entry.get("checks") for entry in entries]
    keyword = " or ".join(sorted({c for cs in checks for c in cs})) if all(checks) else None
    return ",".join(sorted({c for clauses in named for c in clauses})), keyword


def draw(seed: int, then: Path | None, workdir: Path) -> list[Mutant]:
    """Every mutant of the sources, in the order the seed shuffles them. The sources are today's
    (SOURCE), or, for a run drawn at an earlier commit, that commit's files unpacked in `then`
    (the fork's patched lines come from this build's patched tree, which the patch series, left
    unchanged since, makes the same)."""
    root = then or SOURCE
    python = sorted(str(p.relative_to(root)) for p in (root / "retro").glob("*.py") if p.name not in NOT_DRAWN)
    mutants: list[Mutant] = []
    for rel in OWN + python:
        mutants += generate(root / rel, rel, None, workdir)
    for rel in FORK:
        mutants += generate(PREPARED / rel, f"llama.cpp/{rel}", patched_lines(rel), workdir)
    random.Random(seed).shuffle(mutants)
    return mutants


def unpack(commit: str, dest: Path) -> Path:
    """The files mutants are drawn from, as `commit` has them."""
    if subprocess.run(["git", "diff", "--quiet", commit, "--", "vendor"], cwd=REPO).returncode != 0:
        raise SystemExit(f"the patch series changed since {commit}: its fork mutants cannot be drawn again")
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", commit, "--", *OWN, "retro"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(
            subprocess.run(["git", "show", f"{commit}:{name}"], cwd=REPO, capture_output=True, check=True).stdout
        )
    return dest


def port(m: Mutant, then: Path, workdir: Path) -> bool:
    """Put a mutant drawn from an earlier commit's file onto today's: its line, where the file
    around it is unchanged (difflib's matching blocks), becomes the mutated line; m.path is then
    today's file so mutated. False when the line itself changed since the draw (or the file went)."""
    if m.file.startswith("llama.cpp/"):
        return True  # the patched tree is the same (unpack checked the series)
    if not (SOURCE / m.file).exists():
        return False
    old = (then / m.file).read_text(encoding="utf-8").splitlines(keepends=True)
    new = (SOURCE / m.file).read_text(encoding="utf-8").splitlines(keepends=True)
    mutated = Path(m.path).read_text(encoding="utf-8").splitlines(keepends=True)[m.line - 1]
    i = m.line - 1
    for a, b, size in difflib.SequenceMatcher(None, old, new, autojunk=False).get_matching_blocks():
        if a <= i < a + size:
            j = b + i - a
            ported = workdir / "ported" / re.sub(r"\W", "_", m.file) / f"{j + 1}.{Path(m.path).name}"
            ported.parent.mkdir(parents=True, exist_ok=True)
            ported.write_text("".join([*new[:j], mutated, *new[j + 1 :]]), encoding="utf-8")
            m.path = str(ported)  # m.line stays the line in the draw's sources
            return True
    return False


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
        elif e.get("kind") == "commutative-arguments":
            if _swaps_arguments(m.original, m.mutated, e["functions"]):
                return e["reason"]
        elif e.get("kind") == "seeded-defect-arm":
            if any(_within(m, arm) for flag in e["flags"] for arm in _defect_arms(m.original, flag)):
                return e["reason"]
        elif e.get("kind") == "annotation-only":
            if _annotation_only(m):
                return e["reason"]
        elif _names(e, m):
            return e["reason"]
    return None


def _names(e: dict, m: Mutant) -> bool:
    """Whether an entry names the mutant: file, original (or one of `originals`: a block whose every
    line holds for one reason) and (if given) mutated line, and the line above it where the entry
    says which (two equal lines of one file told apart)."""
    originals = e.get("originals", [e.get("original")])
    same = e.get("file") == m.file and m.original in originals and e.get("mutated", m.mutated) == m.mutated
    return same and ("preceded_by" not in e or _line_before(m) == e["preceded_by"])


def _mutant_lines(m: Mutant) -> tuple[list[str], int]:
    """The mutant's file and its line's 0-based index: the file it was judged in, or, once that is
    gone (a saved run re-triaged), today's sources with the mutant put onto them."""
    if Path(m.path).exists():
        return Path(m.path).read_text(encoding="utf-8").splitlines(keepends=True), m.line - 1
    return onto_today(m.file, m.line, m.original, m.mutated)


def _line_before(m: Mutant) -> str | None:
    """The line above the mutant's (an entry can tell two equal lines apart so)."""
    lines, i = _mutant_lines(m)
    return lines[i - 1].strip() if i >= 1 else None


def _annotation_only(m: Mutant) -> bool:
    """Whether a Python mutant changes nothing but annotations, in a module that never evaluates
    them (`from __future__ import annotations`): the two modules' trees match with annotations gone."""
    if not m.file.endswith(".py"):
        return False
    lines, i = _mutant_lines(m)
    before = lines.copy()
    before[i] = lines[i][: len(lines[i]) - len(lines[i].lstrip())] + m.original + "\n"
    try:
        trees = [ast.parse("".join(text)) for text in (before, lines)]
    except SyntaxError:
        return False
    if not any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in trees[0].body
    ):
        return False
    return ast.dump(_without_annotations(trees[0])) == ast.dump(_without_annotations(trees[1]))


def _without_annotations(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
        elif isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(None)
    return tree


def _tight(code: str) -> str:
    """Code without the spaces around punctuation (the spaces between two words stay)."""
    return re.sub(r"\s+", " ", re.sub(r"\s*([^\w\s])\s*", r"\1", code)).strip()


def _swaps_arguments(original: str, mutated: str, functions: list[str]) -> bool:
    """Whether the mutant only swaps the two (simple) arguments of one call of the functions."""
    a, b = _tight(original), _tight(mutated)
    call = re.compile(r"\b(?:" + "|".join(map(re.escape, functions)) + r")\(([^(),]+),([^(),]+)\)")
    return any(a[: c.start(1)] + c[2] + "," + c[1] + a[c.end(2) :] == b for c in call.finditer(a))


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
    ap.add_argument("--sample", type=int, help="mutants to judge: killed, weak or survived (80; --resume: as saved)")
    ap.add_argument("--seed", type=int, help="the shuffle the sample is drawn from, in order (1; --resume: as saved)")
    ap.add_argument("--case-timeout", type=float, default=120.0)
    ap.add_argument("--out", type=Path, default=REPO / "build" / "mutation-results.json")
    ap.add_argument("--only", action="append", default=None, help="draw mutants from this file only (repeatable)")
    ap.add_argument(
        "--pinned",
        type=Path,
        help="judge the mutants this TOML file names ([[mutant]] file, line, original, mutated), not a draw",
    )
    ap.add_argument(
        "--no-defect-proof",
        action="store_true",
        help="do not certify the unmutated build with its seeded-defect runs up front, where another run "
        "proves them (the test suite's full certification does); a mutant the intact runs let through "
        "still gets its seeded-defect runs, against a baseline made then",
    )
    ap.add_argument("--resume", action="store_true", help="go on with the run in --out (same sources and seed)")
    ap.add_argument(
        "--rejudge",
        action="store_true",
        help="with --resume: judge again the mutants that survived or were weak kills (the checks changed since)",
    )
    ap.add_argument("--rescore", action="store_true", help="re-triage the survivors of --out against equivalent.toml")
    args = ap.parse_args(argv)
    saved = json.loads(args.out.read_text(encoding="utf-8")) if (args.resume or args.rescore) else None
    args.seed = args.seed if args.seed is not None else (saved["seed"] if saved else 1)
    args.sample = args.sample if args.sample is not None else (saved["sample"] if saved else 80)
    if args.rescore:
        sync_source()  # a saved mutant whose file is gone is put onto today's sources to be re-triaged
        drawn = [Mutant(**m) for m in saved["mutants"]]
        for m in drawn:
            reason = known_equivalent(m, equivalents()) if m.outcome in ("survived", "weak") else None
            if reason:
                m.outcome, m.detail = "equivalent", reason
        run = Run(saved["seed"], saved["sample"], saved["generated"], saved["digest"], drawn, saved.get("commit"))
        return report(run, args.out)

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
        for rel in PYTHON:  # a Python mutant is put in place in the build, not rebuilt
            if (site / rel).read_bytes() != (SOURCE / rel).read_bytes():
                print(f"{rel} is not installed as written: cannot put its mutants in place", file=sys.stderr)
                return 2
        judge = Judge(site, work, args.case_timeout, *(pinned_scope(args.pinned) if args.pinned else (COVERED, None)))
        intact = judge.intact_baseline()
        if intact.failed and not judge.rerun(intact.failed).failed:
            # a check on a loaded machine failed by chance; the same rule as a mutant's kill
            print(f"the unmutated build failed {', '.join(intact.failed)} once, then passed", flush=True)
            # whole once more: a run that stopped at its first failure holds no verdicts after it,
            # and every mutant's run is compared with these
            intact = judge.intact_baseline()
        short = intact.failed or ([] if args.no_defect_proof else judge.defect_baseline_shortfall())
        if short:
            print(f"the unmutated build is not certified ({', '.join(short)}): nothing to measure", file=sys.stderr)
            return 2

        if args.pinned:
            mutants = pinned(args.pinned, work)
            args.sample = len(mutants)
        else:
            mutants = draw(args.seed, None, work / "mutants")
        if args.only:
            mutants = [m for m in mutants if m.file in args.only]
        run = Run(
            args.seed, args.sample, len(mutants), digest(mutants), [], None if args.pinned else drawn_at(args.only)
        )
        then = None
        if saved and (saved["digest"], saved["seed"]) != (run.digest, run.seed):
            # the sources changed since the draw: draw again from the commit it was made at, and
            # put each mutant onto today's file (a line changed since is drawn past as stale)
            commit = saved.get("commit")
            if not commit or saved["seed"] != run.seed:
                print(f"{args.out} was drawn from other sources or another seed: cannot resume it", file=sys.stderr)
                return 2
            then = unpack(commit, work / "then")
            mutants = draw(args.seed, then, work / "mutants-then")
            if digest(mutants) != saved["digest"]:
                print(f"{args.out}: the draw at {commit} is not the one saved: cannot resume it", file=sys.stderr)
                return 2
            run = Run(args.seed, args.sample, len(mutants), saved["digest"], [], commit)
            print(f"resuming the draw made at {commit[:12]} on today's sources", flush=True)
        if saved:
            run.commit = saved.get("commit")
            run.drawn = [Mutant(**m) for m in saved["mutants"] if m["outcome"]]
            for m, kept in zip(mutants, run.drawn):
                kept.path = m.path  # the mutant files of this run
        known = equivalents()
        print(f"{run.generated} mutants generated; judging {run.sample}, {run.judged} judged already", flush=True)
        checks = checks_at()
        # survivors and weak kills again, but not those these very checks judged (a resumed rejudge)
        again = [m for m in run.drawn if m.outcome in ("survived", "weak") and not (checks and m.checks == checks)]
        again = again if args.rejudge else []
        try:
            for m in again:
                reason = known_equivalent(m, known)  # found equivalent since it was judged
                if reason:
                    m.outcome, m.detail = "equivalent", reason
                elif then and not port(m, then, work):
                    m.outcome, m.detail = "stale", "the line changed since the draw"
                else:
                    judge.mutant(m)
                    m.checks = checks or ""
                save(run, args.out)
                print(f"[again] {m.file}:{m.line} {m.outcome} ({m.seconds} s)" + (f" [{m.detail}]" if m.detail else ""))
            for m in mutants[len(run.drawn) :]:
                if run.judged >= run.sample:
                    break
                run.drawn.append(m)
                reason = known_equivalent(m, known)
                if reason:
                    m.outcome, m.detail = "equivalent", reason
                elif then and not port(m, then, work):
                    m.outcome, m.detail = "stale", "the line changed since the draw"
                else:
                    judge.mutant(m)
                    m.checks = checks or ""
                save(run, args.out)
                print(
                    f"[{run.judged}/{run.sample}] {m.file}:{m.line} {m.outcome} ({m.seconds} s): "
                    f"{m.original!r} -> {m.mutated!r}" + (f" [{m.detail}]" if m.detail else ""),
                    flush=True,
                )
        finally:
            build(site)  # leave the build folder as the sources are
    return report(run, args.out)


JUDGED = ("killed", "weak", "survived")


@dataclass
class Run:
    seed: int
    sample: int  # mutants to judge
    generated: int
    digest: str  # of the shuffled mutants: a run resumes only over the same draw
    drawn: list[Mutant]  # in draw order, the invalid and the equivalent included
    commit: str | None = None  # the commit whose sources were drawn (None: a working tree's edits)

    @property
    def judged(self) -> int:
        return sum(m.outcome in JUDGED for m in self.drawn)


def _head_if_unedited(paths: list[str]) -> str | None:
    """HEAD, when these paths of the working tree are as HEAD has them."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    edited = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *paths], cwd=REPO).returncode
    return head if head and edited == 0 else None


#: the commits the copied sources are, taken when they are copied (sync_source): a commit made
#: while a run goes on is not what it judges
SYNCED: dict[str, str | None] = {}


def drawn_at(only: list[str] | None) -> str | None:
    """HEAD, when the files mutants are drawn from were as HEAD had them when they were copied: a
    later run can then draw the same mutants again from that commit, whatever the sources have
    become."""
    return SYNCED.get("drawn") if not only else None


def checks_at() -> str | None:
    """HEAD, when the checks and everything they certify were as HEAD had them when copied."""
    return SYNCED.get("checks")


def digest(mutants: list[Mutant]) -> str:
    h = hashlib.sha256()
    for m in mutants:
        h.update(f"{m.file}\0{m.line}\0{m.original}\0{m.mutated}\n".encode())
    return h.hexdigest()


class Judge:
    """Puts each mutant in place, certifies it, and puts the sources back."""

    def __init__(
        self, site: Path, work: Path, timeout: float, scope: str = COVERED, keyword: str | None = None
    ) -> None:
        # the clauses every certification of the run covers, and -k's selection of their checks
        # (the pinned mutants: the ones that killed them; a drawn sample: every clause and check)
        self.site, self.work, self.timeout, self.scope, self.keyword = site, work, timeout, scope, keyword
        self._intact_baseline: Certification | None = None
        self._defect_baseline: Certification | None = None
        self._runs = 0
        # the build holds native code other than the sources' (a mutant's, or an invalid mutant's
        # predecessor): a Python mutant is judged only after a rebuild
        self._stale_native = False

    def _certify(self, *, defects: bool, clauses: list[str] | None = None) -> Certification:
        self._runs += 1
        out = self.work / f"run{self._runs}" / "out"
        out.parent.mkdir()
        return certify(
            self.site,
            out,
            self.timeout,
            defects=defects,
            clauses=",".join(clauses or [self.scope]),
            keyword=self.keyword,
        )

    def intact_baseline(self) -> Certification:
        self._intact_baseline = self._certify(defects=False)
        return self._intact_baseline

    def rerun(self, failed: list[str]) -> Certification:
        """The clauses that failed, run once more without their defects (all of them when the
        run left no results)."""
        return self._certify(defects=False, clauses=None if "(no results)" in failed else failed)

    def differs(self, intact: Certification, clauses: list[str] | None = None) -> list[str]:
        """The clauses an intact run of a mutant reads otherwise than the unmutated build's: a
        failed check, or any other verdict changed (a backend that reads "not available", a check
        that reads "not supported"): a certification that no longer reads as it did."""
        before = self._intact_baseline
        return sorted({*intact.failed, *clauses_of(changed(before, intact, clauses) if before else [])})

    def defect_baseline(self) -> Certification:
        if self._defect_baseline is None:
            self._defect_baseline = self._certify(defects=True)
        return self._defect_baseline

    def defect_baseline_shortfall(self) -> list[str]:
        """What keeps the unmutated build from being certified: failed clauses, or ones not passing
        (but where the registry says a part is not implemented and the rest passes)."""
        base = self.defect_baseline()
        ok = ("pass", "not supported")
        short = base.failed or [k for k, v in base.verdicts.items() if v not in ok and k not in base.partial]
        # a run of every clause exits 0 when certified, a run of some of them 3 (outcomes.EXIT_*)
        passed = (outcomes.EXIT_CERTIFIED, outcomes.EXIT_SELECTION_PASSED)
        return short or ([] if base.returncode in passed else [f"exit status {base.returncode}"])

    def mutant(self, m: Mutant) -> None:
        python = m.file.endswith(".py")
        target = self.site / m.file if python else where(m.file)
        original = target.read_bytes()
        if python and self._stale_native:
            build(self.site)
            self._stale_native = False

        def put(text: bytes) -> bool:
            """The file as text in the build: whether it compiles."""
            target.write_bytes(text)
            if python:
                _drop_bytecode(target)
                try:
                    compile(text.decode("utf-8"), m.file, "exec")
                    return True
                except SyntaxError:
                    return False
            self._stale_native = True
            return build(self.site).returncode == 0

        t0 = time.monotonic()
        try:
            if not put(Path(m.path).read_bytes()):
                m.outcome, m.detail = "invalid", "does not compile"
            elif not self._killed(m):
                if self._defect_baseline is None:
                    # the seeded-defect baseline is the unmutated build's: made with the original in place
                    put(original)
                    self.defect_baseline()
                    put(Path(m.path).read_bytes())
                self._weak_or_survived(m)
        finally:
            target.write_bytes(original)
            if python:
                _drop_bytecode(target)
        m.seconds = round(time.monotonic() - t0, 1)

    def _killed(self, m: Mutant) -> bool:
        """Judge by the intact runs; a check on a loaded machine can fail by chance, so a kill is a
        failure that a second run of the clauses that failed repeats (a mutant failing
        intermittently, twice over, is killed too)."""
        m.outcome, m.detail = "", ""
        chance = []
        for _ in range(2):
            intact = self._certify(defects=False)
            differs = self.differs(intact)
            if not differs:
                return False
            again = self.rerun(differs)
            if self.differs(again, None if "(no results)" in differs else differs):
                m.outcome = "killed"
                base = self._intact_baseline
                moved = [f"{k}: {intact.verdicts.get(k)}" for k in (changed(base, intact) if base else [])[:4]]
                first = again.first_failure or intact.first_failure or "; ".join(moved)
                m.detail = f"failed, twice: {', '.join(differs)} ({first})"
                return True
            chance.append(", ".join(differs))
        m.outcome, m.detail = "killed", "failed intermittently: " + "; ".join(chance)
        return True

    def _weak_or_survived(self, m: Mutant) -> None:
        """The intact runs let it through: only the seeded-defect runs can still tell."""
        short = lost(self.defect_baseline(), self._certify(defects=True))
        if short:
            m.outcome, m.detail = "weak", "only a seeded-defect run tells: " + ", ".join(short)
        else:
            m.outcome, m.detail = "survived", ""


def _drop_bytecode(module: Path) -> None:
    """A mutant written in the same second as the module it replaces can keep the old bytecode."""
    for pyc in (module.parent / "__pycache__").glob(f"{module.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def summary(run: Run) -> dict:
    counts = {k: sum(m.outcome == k for m in run.drawn) for k in (*JUDGED, "invalid", "equivalent", "stale")}
    judged = run.judged
    return {
        "seed": run.seed,
        "sample": run.sample,
        "generated": run.generated,
        "digest": run.digest,
        "commit": run.commit,
        "drawn": len(run.drawn),
        "judged": judged,
        "complete": judged >= run.sample,
        **counts,
        # a weak kill is not a kill: the certification's intact runs let it through
        "score_percent": round(100.0 * counts["killed"] / judged, 1) if judged else 0.0,
        "score_with_weak_percent": round(100.0 * (counts["killed"] + counts["weak"]) / judged, 1) if judged else 0.0,
        "mutants": [asdict(m) for m in run.drawn],
    }


def save(run: Run, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary(run), indent=1) + "\n", encoding="utf-8")
    tmp.replace(out)  # a run stopped mid-write keeps the last whole record


def report(run: Run, out: Path) -> int:
    save(run, out)
    s = summary(run)
    print(
        f"mutation score: {s['score_percent']:.1f} % ({s['killed']} of {s['judged']} judged mutants killed by the "
        f"intact certification; {s['weak']} weak kills, only a seeded-defect run tells: "
        f"{s['score_with_weak_percent']:.1f} % with them; {s['survived']} survived; "
        f"{s['invalid']} invalid and {s['equivalent']} equivalent not counted; seed {run.seed}, "
        f"{s['drawn']} drawn of {run.generated}){'' if s['complete'] else ' - incomplete: --resume goes on'}; "
        f"results in {out}"
    )
    for m in run.drawn:
        if m.outcome in ("survived", "weak"):
            print(f"  {m.outcome}: {m.file}:{m.line}: {m.original!r} -> {m.mutated!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
