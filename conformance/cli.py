"""retro-conformance: certify the contracts on the backends of this machine, merge shards.

  retro-conformance certify [--backend cpu|rpc|cuda|vulkan|all] [--out DIR] [--clauses PREFIXES]
  retro-conformance merge SHARD_DIR... --out DIR
  retro-conformance verify DIR
  retro-conformance gate topology-cache DIR [--target cpu,vulkan]
  retro-conformance diff OLD_DIR NEW_DIR [--markdown FILE]
  retro-conformance clauses

certify and merge exit 0 when every requested backend that is available is certified (every clause
of the registry passes there, at every shape profile), 3 when none failed and one or more passed
only a selection (of clauses: --clauses, or shards that together hold less than the registry; or
of shape profiles: --shape) and so certified nothing, 1 when a backend is not certified (or none is
available), 2 on an error of the harness itself. gate exits 0 when the gate enables,
1 when it refuses. diff exits 1 when a clause or case regressed from OLD to NEW.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from retro import _child

from . import backends as backends_mod
from . import gate as gates
from . import outcomes, registry, results, shapes

CASES_DIR = Path(__file__).parent / "cases"
INI = Path(__file__).parent / "pytest.ini"
MAX_RESTARTS = 50
#: the outcomes of a check that --exitfirst stops at
FAILED = ("fail", "crash", "survived")


def _read_log(path: Path) -> tuple[list[dict], dict | None]:
    """Finished case records, and the case that started without finishing (None if every one did)."""
    if not path.exists():
        return [], None
    done, open_start = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if rec["event"] == "start":
            open_start = rec
        elif rec["event"] == "result":
            done.append(rec)
            if open_start and open_start["nodeid"] == rec["nodeid"]:
                open_start = None
    return done, open_start


def _progress_line(backend: str, n: int, rec: dict) -> str:
    defect = f" [defect {rec['defect']}]" if rec.get("defect") else ""
    return f"  {backend} {n:4}  {rec['id']}{defect}: {rec['outcome']} ({rec.get('duration_s', 0):.1f} s)"


def _run_watched(
    cmd: list[str], cwd: Path, env: dict[str, str], log: Path, case_timeout: float, progress: str | None = None
) -> tuple[int, str, bool]:
    """Run a child pytest; kill it (and whatever it started) when one case outlives case_timeout.
    With `progress` (the backend's name), print each case as it finishes."""
    printed = 0

    def report() -> None:
        nonlocal printed
        done, _ = _read_log(log)
        for rec in done[printed:]:
            printed += 1
            if progress:
                print(_progress_line(progress, printed, rec), flush=True)

    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        while proc.poll() is None:
            time.sleep(0.2)
            _, running = _read_log(log)
            report()
            if running is not None and time.time() - running["t"] > case_timeout:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        report()
        out.seek(0)
        return proc.returncode, out.read(), timed_out


def _pytest_command(name: str, args: argparse.Namespace) -> list[str]:
    """The child pytest of a certification on backend `name`: its own plugins and settings."""
    cmd = _child.python(
        "-m",
        "pytest",
        str(args.cases),
        "-c",
        str(INI),
        "--rootdir",
        str(args.cases.parent),
        "-q",
        "--no-header",
        "--import-mode=importlib",
        "-p",
        "retro.conformance.plugin",
        "-p",
        "_hypothesis_pytestplugin",
        f"--backend={name}",
        f"--retro-seed={args.seed}",
        f"--shape={args.shape}",
    )
    if args.clauses:
        cmd.append(f"--clauses={args.clauses}")
    if args.no_defects:
        cmd.append("--no-defects")
    if args.keyword:
        cmd += ["-k", args.keyword]
    return cmd


def _child_env(args: argparse.Namespace, extra_env: dict[str, str]) -> dict[str, str]:
    # a certification run loads exactly its own plugins and settings, whatever pytest session
    # (xdist worker, PYTEST_ADDOPTS, third-party plugins) it was started from
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(extra_env, PYTHONFAULTHANDLER="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    threads = getattr(args, "threads", None)
    if threads:
        env["RETRO_THREADS"] = str(threads)  # the same for every check at any -j: results do not move
    return env


def collect(name: str, args: argparse.Namespace, workdir: Path, extra_env: dict[str, str]) -> list[str]:
    """The node ids of every case a run on backend `name` would run, in pytest's order."""
    cmd = [*_pytest_command(name, args), "--collect-only"]  # -q is in the command: one node id a line
    proc = subprocess.run(cmd, cwd=workdir, env=_child_env(args, extra_env), capture_output=True, text=True)
    if proc.returncode not in (0, 5):
        raise RuntimeError(f"collecting the cases of backend {name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def run_backend(
    name: str,
    args: argparse.Namespace,
    workdir: Path,
    extra_env: dict[str, str],
    nodeids: list[str] | None = None,
    tag: str = "",
) -> list[dict]:
    """Run the selected cases on one backend (those of `nodeids` only, when given) in child
    interpreters. A case that kills its interpreter, or hangs past --case-timeout, is recorded as
    a crash and the run goes on with the cases after it (HARNESS-05)."""
    log = workdir / f"{name}{tag}.jsonl"
    only = workdir / f"{name}{tag}.cases"
    if nodeids is not None:
        only.write_text("\n".join(nodeids) + "\n", encoding="utf-8")
    cases: list[dict] = []
    skip: list[str] = []
    for _ in range(MAX_RESTARTS):
        log.unlink(missing_ok=True)
        cmd = [*_pytest_command(name, args), f"--results-log={log}"]
        if nodeids is not None:
            cmd.append(f"--only-cases={only}")
        if args.exitfirst:
            cmd.append("--exitfirst")
        cmd += [f"--deselect={n}" for n in skip]
        env = _child_env(args, extra_env)
        returncode, output, timed_out = _run_watched(
            cmd, workdir, env, log, args.case_timeout, progress=name + tag if args.progress else None
        )
        if args.verbose:
            sys.stdout.write(output)
        done, crashed = _read_log(log)
        cases += done
        skip += [r["nodeid"] for r in done]
        if crashed is not None and registry.seeded("HARNESS-05"):
            return cases  # seeded defect: the run ends with the interpreter that died
        if crashed is None:
            if returncode not in (0, 1, 5):
                raise RuntimeError(f"pytest on backend {name} ended with code {returncode}:\n{output[-4000:]}")
            return cases
        tail = "\n".join(output.strip().splitlines()[-15:])
        what = (
            f"the case ran over {args.case_timeout:g} s and its interpreter was killed"
            if timed_out
            else f"the interpreter died (exit code {returncode}) running this case"
        )
        cases.append(
            results.case_record(
                nodeid=crashed["nodeid"],
                id=crashed["id"],
                clauses=crashed["clauses"],
                backend=name,
                defect=crashed["defect"],
                outcome="crash",
                duration_s=round(time.time() - crashed["t"], 3),
                message=f"{what}\n{tail}",
            )
        )
        skip.append(crashed["nodeid"])
        if args.exitfirst:
            return cases
        if args.progress:
            print(f"  {name}       {crashed['id']}: crash ({what}); going on with the cases after it", flush=True)
    # every case crashing (a broken build): what ran is reported, the rest is one crash record
    cases.append(
        results.case_record(
            nodeid=f"{name}{tag}::restart-budget",
            id="restart budget",
            clauses=registry.select(registry.prefixes(args.clauses)),
            backend=name,
            defect=None,
            outcome="crash",
            duration_s=0.0,
            message=f"{MAX_RESTARTS} interpreters died; the cases not yet run were abandoned",
        )
    )
    return cases


def run_info(args: argparse.Namespace) -> dict:
    import retro

    info = retro.build_info()
    return {
        "start_time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "retro": retro.__version__,
        "llama_cpp": info["llama_cpp_commit"],
        "llama_cpp_source": info["source"],
        "patch_series_sha256": info["patch_series_sha256"],
        "patches": info["patches"],
        "built_backends": info["backends"],
        "build_config": info.get("config", {}),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": platform.node(),
        "seed": args.seed,
        "shapes": [s.name for s in shapes.parse(args.shape)],
        "selection": args.clauses or "all",
        "seeded_defects": not args.no_defects,
        **({"numerics": {"rpc": args.numerics}} if args.numerics != "cpu" else {}),
        **({"partial": _partial(args)} if args.keyword or args.exitfirst else {}),
        "command": " ".join(["retro-conformance", *sys.argv[1:]]),
    }


def _partial(args: argparse.Namespace) -> str:
    """What keeps a run from judging a whole backend, even where every check it ran passed."""
    parts = [f"-k {args.keyword}"] if args.keyword else []
    return "; ".join([*parts, *(["--exitfirst: stops at the first failure"] if args.exitfirst else [])])


def certify(args: argparse.Namespace) -> int:
    from retro._native import hooks

    from . import warm_up

    if not hooks.seeded_defects and not args.no_defects:
        # a check is trusted only once its seeded defect has made it fail: without them none can pass
        raise ValueError(
            "this build has no seeded-defect switches (built with RETRO_SEEDED_DEFECTS=OFF, a release "
            "build): certification needs them to prove each check can fail; certify a default build"
        )
    requested = backends_mod.parse_selection(args.backend)
    if args.numerics != "cpu" and "rpc" not in requested:
        raise ValueError(f"--numerics {args.numerics} is how the RPC servers compute: certify --backend rpc with it")
    prefixes = registry.prefixes(args.clauses)
    clause_ids = registry.select(prefixes)
    if not clause_ids:
        raise ValueError(f"no clause matches {args.clauses!r}")
    run = run_info(args)
    jobs = 1 if args.exitfirst else max(1, args.jobs)  # -x stops at the first failure: one at a time
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="retro-conformance-")))
        servers: list[str] = []
        if "rpc" in requested and "rpc" in run["built_backends"]:
            # the RPC backend's devices: servers on 127.0.0.1 for the whole run, serving their CPU,
            # one per worker (a server serves one client at a time)
            from retro.rpc import Server

            servers = [
                stack.enter_context(Server(threads=args.threads, numerics=args.numerics)).endpoint for _ in range(jobs)
            ]

        def env_of(name: str, worker: int) -> dict[str, str]:
            if name != "rpc" or not servers:
                return {}
            return {
                backends_mod.RPC_SERVERS_ENV: servers[worker],
                backends_mod.RPC_NUMERICS_ENV: args.numerics,
                backends_mod.RPC_DEADLINE_ENV: str(max(s.step_deadline_s for s in shapes.parse(args.shape))),
            }

        found = backends_mod.discover_isolated({**os.environ, **env_of("rpc", 0)})
        runnable = []
        for name in requested:
            if found[name].available:
                print(f"certifying {name}: {found[name].description}", flush=True)
                runnable.append(name)
            else:
                print(f"{name}: not available ({found[name].reason})", flush=True)
        # kernels a device compiles on first use are compiled before any check runs (warm_up.py)
        run["warm_up_s"] = {}
        for name in (n for n in runnable if n not in backends_mod.PRECOMPILED):
            seconds, failure = warm_up.warm(
                name, tmp / "warm-up" / name, args.shape, _child_env(args, env_of(name, 0)), args.case_timeout
            )
            run["warm_up_s"][name] = seconds
            print(f"{name}: warmed up in {seconds:g} s" + (f" (it failed, {failure})" if failure else ""), flush=True)
        cases = _run_all(runnable, args, tmp, env_of, jobs)
    expectations = {n: results.load_expectations(n) for n in requested}
    if not (args.clauses or args.keyword or args.exitfirst):  # only a full run can tell an entry is stale
        for n in requested:
            stale = results.stale_expectations(n, expectations[n], cases) if found[n].available else []
            if stale:
                raise ValueError(
                    f"expectations/{n}.toml: stale entries (no such case ran): " + ", ".join(e.case for e in stale)
                )
    listed = requested
    if registry.seeded("HARNESS-01.dropped"):
        listed = runnable  # seeded defect: a backend asked for and absent drops out of the package
    res = results.aggregate(run, {n: found[n].to_json() for n in listed}, cases, clause_ids, expectations)
    results.write_all(res, args.out)
    return _summarize(res, args.out)


def deal(nodeids: list[str], workers: int) -> list[list[str]]:
    """The cases of one backend dealt to `workers`: every run of one check function (its
    parameters, its seeded-defect runs) to the same worker, so that what a check builds once per
    interpreter is built once; the largest checks first, each to the least loaded worker; each
    worker's cases in pytest's order."""
    groups: dict[str, list[int]] = {}
    for i, nodeid in enumerate(nodeids):
        groups.setdefault(nodeid.split("[", 1)[0], []).append(i)
    loads: list[list[int]] = [[] for _ in range(workers)]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(loads, key=len).extend(members)
    return [[nodeids[i] for i in sorted(load)] for load in loads]


def _run_all(
    names: list[str], args: argparse.Namespace, tmp: Path, env_of: Callable[[str, int], dict[str, str]], jobs: int
) -> list[dict]:
    """Every case of every backend: one backend after another in one interpreter at a time (-j 1),
    or each backend's cases dealt to `jobs` workers (deal), run side by side with those of the
    other backends. The case records are the same either way; only their order differs."""
    cases: list[dict] = []
    if jobs == 1:
        for name in names:
            if args.exitfirst and any(c["outcome"] in FAILED for c in cases):
                print(f"{name}: not run (--exitfirst: a check has failed)", flush=True)
                continue
            cases += run_backend(name, args, tmp, env_of(name, 0))
        return cases
    with concurrent.futures.ThreadPoolExecutor(len(names) or 1) as pool:
        collected = list(pool.map(lambda n: collect(n, args, tmp, env_of(n, 0)), names))
    tasks = [(name, w, part) for name, ids in zip(names, collected) for w, part in enumerate(deal(ids, jobs)) if part]
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        runs = [pool.submit(run_backend, name, args, tmp, env_of(name, w), part, f"-{w}") for name, w, part in tasks]
        for run in runs:
            cases += run.result()
    return cases


#: the lines that say why a backend is not certified, before the rest is left to report.md
WHY_SHOWN = 10


def _why_not_certified(res: dict, name: str, limit: int = WHY_SHOWN) -> list[str]:
    """Each selected clause short of a pass on `name`, with why, and the first line of the message of
    each of its checks that failed or crashed: the last lines of a CI log name what failed."""
    lines = []
    if res.get("run", {}).get("partial"):  # every clause may pass, and yet checks were left out
        lines.append(f"  the run left checks out: {res['run']['partial']}")
    for cid in res["selected"]:
        status = res["clauses"][cid][name]
        if status == "pass":
            continue
        lines.append(f"  {cid} {status}: {res['clause_details'][cid][name]}")
        for case in res["cases"]:  # the details name escaped defects with their cases already
            if case["backend"] == name and cid in case["clauses"] and not case["defect"] and case["outcome"] in FAILED:
                first = (case["message"] or "").strip().splitlines()[:1]
                lines.append(f"    {case['outcome']}: {case['id']}" + (f": {first[0][:300]}" if first else ""))
    if len(lines) > limit:
        lines = [*lines[:limit], f"  ... {len(lines) - limit} more lines in report.md"]
    return lines


def _summarize(res: dict, out: Path) -> int:
    """The verdict per backend on the console, with why a backend is not certified; the exit code
    of the run (outcomes.EXIT_*): a selection that passed has its own, never a certification's."""
    for name, verdict in res["verdict"].items():
        row = [res["clauses"][c][name] for c in res["selected"]]
        counts = ", ".join(f"{row.count(s)} {s}" for s in dict.fromkeys(row))
        detail = outcomes.verdict_text(res, name) if verdict != "not available" else ""
        print(f"{name}: {verdict} ({counts})" + (f": {detail}" if detail else ""))
        if verdict == "not certified":
            print("\n".join(_why_not_certified(res, name)))
    for decision in res.get("gates", {}).values():
        print("\n".join(gates.summary(decision)))
    print(f"wrote {out / 'results.json'}, {out / 'junit.xml'}, {out / 'report.md'}, {out / 'report.html'}")
    return exit_code(res["verdict"])


def exit_code(verdicts: dict[str, str]) -> int:
    """0 when every requested backend that is available is certified; 3 when each is certified or
    passed the selection it ran (some clauses, some shape profiles), one at least a selection; 1
    otherwise, or when none is available."""
    available = [v for v in verdicts.values() if v != "not available"]
    if not available:
        print("no requested backend is available: nothing was certified", file=sys.stderr)
        return outcomes.EXIT_NOT_CERTIFIED
    if all(v == outcomes.CERTIFIED for v in available):
        return outcomes.EXIT_CERTIFIED
    if all(v in (outcomes.CERTIFIED, outcomes.SELECTION_PASSED) for v in available):
        return outcomes.EXIT_SELECTION_PASSED
    return outcomes.EXIT_NOT_CERTIFIED


def merge(args: argparse.Namespace) -> int:
    parts = [json.loads((Path(d) / "results.json").read_text(encoding="utf-8")) for d in args.shards]
    res = results.merge(parts)
    results.write_all(res, args.out)
    return _summarize(res, args.out)


def verify(args: argparse.Namespace) -> int:
    res = json.loads((Path(args.dir) / "results.json").read_text(encoding="utf-8"))
    results.verify(res)
    print(f"{args.dir}: digest verified ({res['digest']})")
    return 0


def decide_gate(args: argparse.Namespace) -> int:
    """The gate's decision on a results package, with every piece of evidence and every blocker."""
    res = json.loads((Path(args.dir) / "results.json").read_text(encoding="utf-8"))
    results.verify(res)
    targets = [t.strip() for t in args.target.split(",")] if args.target else None
    decision = gates.decide(res, targets)
    print("\n".join(gates.summary(decision, limit=None)))
    shown = decision["evidence"]
    if registry.seeded("HARNESS-08.printed"):
        shown = decision["missing"]  # seeded defect: the blockers printed again in the evidence's place
    for e in shown:
        print(f"  evidence: {e}")
    return 0 if decision["decision"] == "enable" else 1


def diff_packages(args: argparse.Namespace) -> int:
    """What changed from one results package to another; exit 1 on a regression."""
    from . import diff

    old, new = (json.loads((Path(d) / "results.json").read_text(encoding="utf-8")) for d in (args.old, args.new))
    d = diff.compare(old, new)
    print("\n".join(diff.summary(d, limit=None if args.verbose else 20)))
    if args.markdown:
        args.markdown.write_text(diff.markdown(d, args.old, args.new), encoding="utf-8")
        print(f"wrote {args.markdown}")
    return 1 if d.regressed else 0


def list_clauses(args: argparse.Namespace) -> int:
    for c in registry.clauses().values():
        defects = registry.defects_of(c.id)
        flag = f" [seeded defects: {', '.join(defects)}]" if defects else ""
        print(f"{c.id:10} {c.text[:100]}{flag} [reviewers' defects: {registry.reviewed_summary(c.id)}]")
    ds = registry.reviewed_defects().values()
    wanted = registry.OWN_CATCHES_WANTED
    short = [c for c in registry.clauses() if registry.own_catches(c) < wanted]
    print(
        f"reviewers' defects by the rule (own clause, first judgment): {sum(d.counts for d in ds)} of {len(ds)} "
        f"counted; {len(registry.clauses()) - len(short)} of {len(registry.clauses())} clauses have {wanted}"
        + (f"; short: {', '.join(short)}" if short else "")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="retro-conformance", description="Certify the retro contracts on this machine's backends."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("certify", help="run the conformance suite and write results.json, junit.xml, report.md")
    c.add_argument(
        "--backend", default="cpu", help=f"{', '.join(backends_mod.KNOWN)} or all, comma-separated (default cpu)"
    )
    c.add_argument("--out", type=Path, default=Path("conformance-results"))
    c.add_argument(
        "--clauses",
        default=None,
        help="certify only these clauses: comma-separated IDs, or prefixes of IDs (e.g. BASE,FAIL-04,TX-)",
    )
    c.add_argument("--seed", type=int, default=0, help="seed of the generated models and data")
    c.add_argument(
        "--shape",
        default="all",
        help=f"shape profiles to run the checks at: {', '.join(shapes.SHAPES)} or all, comma-separated (default "
        "all); each check runs at those it names, and each clause says at which it passed; a run at some of "
        "them is a selection, never a certification",
    )
    c.add_argument("--no-defects", action="store_true", help="skip the seeded-defect runs (no clause can then pass)")
    c.add_argument(
        "-x",
        "--exitfirst",
        action="store_true",
        help="stop at the first check that fails, crashes or lets its seeded defect survive, and run no "
        "further backend (a mutation run needs one failure; the clauses not reached read not covered)",
    )
    c.add_argument("-k", dest="keyword", default=None, help="pytest -k expression to select checks")
    c.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    c.add_argument("-q", "--quiet", dest="progress", action="store_false", help="no line per finished case")
    c.add_argument(
        "--cases",
        type=lambda text: Path(text).resolve(),  # pytest runs elsewhere: a relative path must not move
        default=CASES_DIR,
        help="folder of conformance checks (default: the built-in suite)",
    )
    c.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="child interpreters run side by side (default: the cores this process may use)",
    )
    c.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads of every check and RPC server (default 1); fixed, so that -j changes no result",
    )
    c.add_argument(
        "--numerics",
        choices=("cpu", "gpu-like", "gpu-like-nearest"),  # retro.rpc.NUMERICS, without loading the native module
        default="cpu",
        help="how the RPC servers' CPU computes matrix products, forward and backward: upstream's (default), or "
        "as CUDA does on an H100/H200 (by the row count: TF32 inputs for 4 to 16 rows, truncated or, "
        "-nearest, rounded; the F32 side against the F16 KV cache in F16; a warp's summation order): the RPC "
        "backend is then held to a GPU's bounds, proving them without a GPU",
    )
    c.add_argument(
        "--case-timeout",
        type=float,
        default=900.0,
        help="seconds one check may run before its interpreter is killed and it is reported as a crash",
    )
    c.set_defaults(func=certify)
    m = sub.add_parser("merge", help="merge the results of several shards or machines into one verdict")
    m.add_argument("shards", nargs="+", help="folders holding a results.json each")
    m.add_argument("--out", type=Path, required=True)
    m.set_defaults(func=merge)
    v = sub.add_parser("verify", help="check a results folder's digest")
    v.add_argument("dir")
    v.set_defaults(func=verify)
    g = sub.add_parser("gate", help="decide a gate from a results package and print its evidence")
    g.add_argument("name", choices=(gates.NAME,))
    g.add_argument("dir", help="a results folder (one shard, or merged shards)")
    g.add_argument("--target", default=None, help="backends to decide for, comma-separated (default: the package's)")
    g.set_defaults(func=decide_gate)
    df = sub.add_parser("diff", help="what changed between two results packages (exit 1 on a regression)")
    df.add_argument("old", help="the earlier results folder (the last release's)")
    df.add_argument("new", help="the later results folder")
    df.add_argument("--markdown", type=Path, default=None, help="also write the diff as a markdown section here")
    df.add_argument("-v", "--verbose", action="store_true", help="list every change, not the first 20 of each kind")
    df.set_defaults(func=diff_packages)
    cl = sub.add_parser("clauses", help="list the clause registry")
    cl.set_defaults(func=list_clauses)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"retro-conformance: error: {err}", file=sys.stderr)
        return outcomes.EXIT_HARNESS_ERROR


if __name__ == "__main__":
    sys.exit(main())
