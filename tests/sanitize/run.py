"""The fault paths and the tensor transactions under AddressSanitizer and UndefinedBehaviorSanitizer,
LeakSanitizer on (``python -m tox -e sanitize``, or ``python tests/sanitize/run.py``).

Builds retro and the patched fork instrumented (``-fsanitize=address,undefined``) into
build/sanitize, then runs the conformance checks of the selected clauses (by default every FAIL
clause: the sweep of every site x hit of the reference epoch, transient and persistent, the leak
counts, the lost RPC link; and every TX- clause) on the CPU and the RPC backend, in interpreters that
see that build and not an installed retro, with the sanitizer runtime preloaded (the interpreter
itself is not instrumented). It fails on any sanitizer report, from any process (certification
children and the RPC server alike), and on any check that did not pass (a check of remote-only
faults reads "not supported" on the CPU, where it runs nothing).

Left out, with their reason: the checks that cap a server's address space (RLIMIT_AS: ASan
reserves terabytes of shadow address space at start, so a capped server cannot start at all)."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from site_view import site_view_env  # noqa: E402

SANITIZE = "-fsanitize=address,undefined -fno-omit-frame-pointer -g1"
#: a pytest -k expression of the checks that cannot run under ASan (see the module's docstring)
UNSANITIZABLE = "not real_allocation_failure"


def runtime(name: str) -> str:
    """The compiler's own sanitizer runtime, which the instrumented libraries were linked against."""
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout
    if not Path(path.strip()).is_absolute():
        raise SystemExit(f"gcc has no {name}: install the compiler's sanitizer runtime")
    return path.strip()


def build(folder: Path) -> Path:
    target = folder / "site"
    shutil.rmtree(target, ignore_errors=True)
    defines = {
        "CMAKE_C_FLAGS": SANITIZE,
        "CMAKE_CXX_FLAGS": SANITIZE,
        "CMAKE_SHARED_LINKER_FLAGS": "-fsanitize=address,undefined",
        "CMAKE_MODULE_LINKER_FLAGS": "-fsanitize=address,undefined",
        "CMAKE_EXE_LINKER_FLAGS": "-fsanitize=address,undefined",
        # ggml's own thread pool: libgomp is not instrumented, and its per-thread allocations at
        # exit would read as leaks
        "RETRO_OPENMP": "OFF",
        # pybind11 strips a release module: a report needs its symbols
        "CMAKE_STRIP": "/bin/true",
    }
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-build-isolation",
        "--disable-pip-version-check",
        "-q",
        "--target",
        str(target),
        f"-Cbuild-dir={folder / 'build'}",
        *(f"-Ccmake.define.{k}={v}" for k, v in defines.items()),
        str(REPO),
    ]
    started = time.monotonic()
    subprocess.run(cmd, check=True)
    print(f"built the instrumented retro in {time.monotonic() - started:.0f} s", flush=True)
    return target


def sanitized_env(target: Path, folder: Path, reports: Path) -> dict[str, str]:
    env = site_view_env(target, folder / "site-view")
    common = f"log_path={reports}/%s:log_exe_name=1"
    env.update(
        # the C++ runtime with it: the interpreter does not load libstdc++ itself, and ASan's
        # interceptor of __cxa_throw finds no real one to call unless it is there at start
        LD_PRELOAD=f"{runtime('libasan.so')} {runtime('libstdc++.so')}",
        ASAN_OPTIONS=":".join(
            [
                common % "asan",
                "detect_leaks=1",
                # a short allocation stack: a leak the interpreter makes at exit shows its own
                # frames on top, one of the fork's or retro's shows theirs (lsan.supp tells them apart)
                "malloc_context_size=5",
                "strict_string_checks=1",
                "detect_stack_use_after_return=1",
            ]
        ),
        UBSAN_OPTIONS=":".join([common % "ubsan", "print_stacktrace=1"]),
        # a leak is judged from the report files: a process that leaked must not fail its caller
        # as well (backend discovery, a certification child), which would hide what ran after it
        LSAN_OPTIONS=f"suppressions={REPO / 'tests' / 'sanitize' / 'lsan.supp'}:print_suppressions=0:exitcode=0",
        GGML_NO_BACKTRACE="1",
        PYTHONFAULTHANDLER="1",
    )
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", type=Path, default=REPO / "build" / "sanitize")
    p.add_argument("--backend", default="cpu,rpc")
    p.add_argument("--clauses", default="FAIL,TX-")
    p.add_argument("-k", default=None, help="a further pytest -k expression")
    p.add_argument("-j", "--jobs", type=int, default=None)
    p.add_argument("--no-build", action="store_true", help="use the instrumented build already in --folder")
    p.add_argument(
        "--defects",
        action="store_true",
        help="run the seeded-defect variants too, and succeed only if the sanitizers report something: "
        "the run shown able to fail (with --clauses FAIL-04, LeakSanitizer finds FAIL-04.leak's context)",
    )
    args = p.parse_args(argv)

    folder = args.folder.resolve()
    target = folder / "site" if args.no_build else build(folder)
    reports = folder / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    reports.mkdir(parents=True)
    out = folder / "results"
    shutil.rmtree(out, ignore_errors=True)
    keyword = UNSANITIZABLE if not args.k else f"({UNSANITIZABLE}) and ({args.k})"
    cmd = [
        sys.executable,
        "-S",  # no .pth processing: an editable install of retro cannot shadow the instrumented one
        "-m",
        "retro.conformance.cli",
        "certify",
        "--backend",
        args.backend,
        "--clauses",
        args.clauses,
        # the intact build is judged; a seeded defect may leak on purpose (FAIL-04.leak)
        *([] if args.defects else ["--no-defects"]),
        "-k",
        keyword,
        "--case-timeout",
        "1800",
        "-q",
        "--out",
        str(out),
        *(["-j", str(args.jobs)] if args.jobs else []),
    ]
    started = time.monotonic()
    run = subprocess.run(cmd, env=sanitized_env(target, folder, reports), cwd=folder)
    print(f"certified under the sanitizers in {time.monotonic() - started:.0f} s (exit {run.returncode})")

    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    backends = results["backends"]
    absent = [n for n in args.backend.split(",") if backends.get(n, {}).get("status") != "available"]
    cases = results["cases"]
    # "not supported": a check of a remote backend's faults on the CPU, which runs nothing there
    bad = [c for c in cases if c["defect"] is None and c["outcome"] not in ("pass", "not supported")]
    found = sorted(reports.iterdir())
    for f in found:
        print(f"== {f.name}\n{f.read_text(errors='replace')[:6000]}")
    for c in bad:
        print(f"{c['nodeid']}: {c['outcome']}: {c['message'][:500]}")
    print(
        f"{len(cases)} checks run, {len(cases) - len(bad)} passed; {len(found)} sanitizer report(s)"
        + (f"; not available: {', '.join(absent)}" if absent else "")
    )
    if args.defects:
        return 0 if found else 1
    return 0 if cases and not bad and not found and not absent else 1


if __name__ == "__main__":
    raise SystemExit(main())
