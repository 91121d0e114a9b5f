"""Get the pinned llama.cpp sources, keep only what libllama + ggml need, apply our patches.

Run by CMake at configure time. The pin is the llama.cpp tree vendored in the llama-cpp-python
sdist named below; pip fetches it (no registry address is written here), the sha256 is checked,
and the sdist is cached outside the build folder so that rebuilds never download again.
A local tree (RETRO_LLAMA_CPP_DIR) replaces the sdist; it is copied, never modified.

The prepared tree carries a stamp of everything that shaped it (source, patch series, backends):
an unchanged stamp leaves the tree and its file times alone, so incremental builds stay incremental.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
UPSTREAM_COMMIT = "0c1e57098"
TREE_IN_SDIST = "llama_cpp_python-0.3.36/vendor/llama.cpp/"

# What the libraries need, relative to the llama.cpp root. ggml/src holds the core sources at its
# top level and one folder per backend: only the enabled backends' folders are kept.
KEEP_DIRS = ("cmake/", "include/", "src/", "ggml/cmake/", "ggml/include/")
KEEP_FILES = (
    "CMakeLists.txt",
    "LICENSE",
    "ggml/CMakeLists.txt",
    # published tokenizers of llama.cpp's tokenizer tests: the realistic shape profile's vocabulary
    # (installed with the binding: retro.testing.models.VOCABULARIES)
    "models/ggml-vocab-llama-spm.gguf",
    "models/ggml-vocab-llama-bpe.gguf",
)
BACKEND_DIRS = {
    "cpu": "ggml/src/ggml-cpu/",
    "rpc": "ggml/src/ggml-rpc/",
    "cuda": "ggml/src/ggml-cuda/",
    "vulkan": "ggml/src/ggml-vulkan/",
}
# always in the tree: the CPU, and the RPC backend (small, CPU-only code, and patched by the series)
ALWAYS = {"cpu", "rpc"}


class PrepareError(RuntimeError):
    pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def patch_series(patch_dir: Path, exclude: set[str]) -> list[Path]:
    patches = sorted(p for p in patch_dir.glob("*.patch") if p.name.split("-", 1)[0] not in exclude)
    return patches


def series_hash(patches: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in patches:
        digest.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return digest.hexdigest()


def default_cache_dir() -> Path:
    if os.environ.get("RETRO_CACHE_DIR"):
        return Path(os.environ["RETRO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "retro"


def fetch_sdist(cache_dir: Path) -> Path:
    cached = cache_dir / SDIST_FILE
    if cached.is_file() and sha256_of(cached) == SDIST_SHA256:
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        # --no-build-isolation: preparing the sdist's metadata needs only scikit-build-core, which
        # the build environment has; isolation would install (or compile) its build tools again.
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-build-isolation",
            "--no-binary",
            SDIST_NAME,
            "--disable-pip-version-check",
            "-d",
            tmp,
            f"{SDIST_NAME}=={SDIST_VERSION}",
        ]
        print("retro: fetching the pinned llama.cpp sources:", " ".join(cmd[2:]), flush=True)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = Path(tmp) / SDIST_FILE
        if done.returncode != 0 or not got.is_file():
            raise PrepareError(f"pip could not fetch {SDIST_NAME}=={SDIST_VERSION}:\n{done.stdout}")
        actual = sha256_of(got)
        if actual != SDIST_SHA256:
            raise PrepareError(f"{SDIST_FILE}: sha256 {actual} does not match the pin {SDIST_SHA256}")
        os.replace(got, cached)
    return cached


def wanted(rel: str, backends: list[str]) -> bool:
    if rel in KEEP_FILES or rel.startswith(KEEP_DIRS):
        return True
    if rel.startswith("ggml/src/"):
        rest = rel[len("ggml/src/") :]
        if "/" not in rest:
            return True
        return any(rel.startswith(BACKEND_DIRS[b]) for b in backends)
    return False


def extract_sdist(sdist: Path, dest: Path, backends: list[str]) -> None:
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(TREE_IN_SDIST) or not (m.isfile() or m.isdir()):
                continue
            rel = m.name[len(TREE_IN_SDIST) :]
            if rel and wanted(rel, backends):
                m.name = rel
                members.append(m)
        tar.extractall(dest, members=members, filter="data")


def copy_local(tree: Path, dest: Path, backends: list[str]) -> None:
    if not (tree / "src" / "llama-context.cpp").is_file():
        raise PrepareError(f"{tree} is not a llama.cpp tree (no src/llama-context.cpp)")
    for path in sorted(tree.rglob("*")):
        rel = path.relative_to(tree).as_posix()
        if path.is_file() and not rel.startswith(".git") and wanted(rel, backends):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def for_tree(patch: str, backends: list[str]) -> str:
    """The patch without its sections for backends the tree leaves out (one patch may change a
    kernel of every backend alike)."""
    sections = re.split(r"(?m)^(?=diff --git )", patch)
    kept = [sections[0]]  # the What/Why header
    for section in sections[1:]:
        path = re.match(r"diff --git a/(\S+) ", section)
        if path is None or wanted(path.group(1), backends):
            kept.append(section)
    return "".join(kept)


def apply_patches(tree: Path, patches: list[Path], backends: list[str]) -> None:
    for p in patches:
        text = for_tree(p.read_text(), backends)
        if not re.search(r"(?m)^--- a/", text):
            continue  # a patch of backends this tree leaves out: nothing of it is here
        done = subprocess.run(
            ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch"],
            input=text,
            cwd=tree,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if done.returncode != 0:
            raise PrepareError(
                f"patch {p.name} does not apply to the llama.cpp tree:\n{done.stdout}\n"
                "The patch series must match the pinned upstream commit " + UPSTREAM_COMMIT
            )


def sync_tree(src: Path, dest: Path) -> None:
    """Make dest a copy of src, leaving the files whose bytes did not change (and their times)
    alone: a new patch recompiles only what it touches."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {p.relative_to(src) for p in src.rglob("*") if p.is_file()}
    for p in sorted(dest.rglob("*"), reverse=True):  # children before their folders
        rel = p.relative_to(dest)
        if p.is_file() and rel not in wanted and rel.name != ".retro-stamp.json":
            p.unlink()
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()
    for rel in sorted(wanted):
        new, old = src / rel, dest / rel
        if old.is_file() and old.stat().st_size == new.stat().st_size and old.read_bytes() == new.read_bytes():
            continue
        old.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(new, old)  # stamped now, never with the archive's older time: it must rebuild
        shutil.copymode(new, old)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, help="folder for the prepared tree")
    ap.add_argument("--patches", type=Path, help="folder with NNNN-*.patch")
    ap.add_argument(
        "--export-upstream",
        type=Path,
        default=None,
        help="only write the pinned upstream tree, unpatched and pruned to --backends, here (for a machine with "
        "no network: RETRO_LLAMA_CPP_DIR there)",
    )
    ap.add_argument(
        "--backends", default="cpu", help="comma-separated backends the build compiles: cpu,rpc,cuda,vulkan"
    )
    ap.add_argument("--local-tree", type=Path, default=None, help="an upstream tree to use instead of the sdist")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--exclude-patches", default="", help="comma-separated patch numbers to leave out")
    ap.add_argument("--info", type=Path, default=None, help="write the pin and series hash as JSON here")
    args = ap.parse_args(argv)

    # built: what the build compiles (build info); backends: the sources the tree keeps
    built = sorted({b.strip().lower() for b in args.backends.split(",") if b.strip()} | {"cpu"})
    backends = sorted(set(built) | ALWAYS)
    unknown = [b for b in backends if b not in BACKEND_DIRS]
    if unknown:
        raise PrepareError(f"unknown backend(s) {unknown}; known: {sorted(BACKEND_DIRS)}")
    if args.export_upstream:
        if args.export_upstream.exists():
            raise PrepareError(f"{args.export_upstream} exists: export into a new folder")
        extract_sdist(fetch_sdist(args.cache_dir or default_cache_dir()), args.export_upstream, backends)
        print(f"retro: wrote the pinned llama.cpp tree ({', '.join(backends)}) to {args.export_upstream}", flush=True)
        return 0
    if args.dest is None or args.patches is None:
        raise PrepareError("--dest and --patches are required (unless --export-upstream)")
    exclude = {e.strip() for e in args.exclude_patches.split(",") if e.strip()}
    patches = patch_series(args.patches.resolve(), exclude)
    source = f"local:{args.local_tree.resolve()}" if args.local_tree else f"sdist:{SDIST_SHA256}"
    stamp = {
        "source": source,
        "series": series_hash(patches),
        "backends": backends,
        "patches": [p.name for p in patches],
        "kept": list(KEEP_FILES),
    }

    stamp_file = args.dest / ".retro-stamp.json"
    if not (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
        fresh = args.dest.with_name(args.dest.name + ".preparing")
        if fresh.exists():
            shutil.rmtree(fresh)
        fresh.mkdir(parents=True)
        if args.local_tree:
            copy_local(args.local_tree, fresh, backends)
        else:
            extract_sdist(fetch_sdist(args.cache_dir or default_cache_dir()), fresh, backends)
        apply_patches(fresh, patches, backends)
        stamp_file.unlink(missing_ok=True)  # an interrupted sync must not look prepared
        sync_tree(fresh, args.dest)
        shutil.rmtree(fresh)
        stamp_file.write_text(json.dumps(stamp, indent=1))
        print(f"retro: prepared llama.cpp ({source}) with {len(patches)} patches in {args.dest}", flush=True)

    if args.info:
        info = {
            "llama_cpp_commit": UPSTREAM_COMMIT,
            "sdist": f"{SDIST_NAME}=={SDIST_VERSION}",
            "sdist_sha256": SDIST_SHA256,
            "source": source,
            "patch_series_sha256": stamp["series"],
            "patches": stamp["patches"],
            "backends": built,
        }
        args.info.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PrepareError as err:
        print(f"retro: {err}", file=sys.stderr)
        sys.exit(1)
