"""vendor/prepare_llama_cpp.py: what is extracted, how patches apply, when the tree is rebuilt."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "vendor" / "prepare_llama_cpp.py"
spec = importlib.util.spec_from_file_location("prepare_llama_cpp", SCRIPT)
prep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prep)


def fake_tree(root):
    files = {
        "CMakeLists.txt": "project(x)\n",
        "LICENSE": "MIT\n",
        "src/llama-context.cpp": "int a = 1;\n",
        "include/llama.h": "",
        "ggml/CMakeLists.txt": "",
        "ggml/src/ggml.c": "",
        "ggml/src/ggml-cpu/ops.cpp": "",
        "ggml/src/ggml-cuda/x.cu": "",
        "common/common.cpp": "",
        "tools/server/s.cpp": "",
        "vendor/x/y.h": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def patch_dir(tmp_path, body):
    d = tmp_path / "patches"
    d.mkdir()
    (d / "0001-change.patch").write_text("Subject: a change\n\nWhat: ... Why: ...\n\n" + body)
    return d


GOOD = """--- a/src/llama-context.cpp
+++ b/src/llama-context.cpp
@@ -1 +1 @@
-int a = 1;
+int a = 2;
"""


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_only_library_sources_of_enabled_backends_are_kept():
    assert prep.wanted("src/llama.cpp", ["cpu"]) and prep.wanted("ggml/src/ggml.c", ["cpu"])
    assert prep.wanted("ggml/src/ggml-cpu/ops.cpp", ["cpu"])
    assert not prep.wanted("ggml/src/ggml-cuda/x.cu", ["cpu"]) and prep.wanted(
        "ggml/src/ggml-cuda/x.cu", ["cpu", "cuda"]
    )
    for rel in ("common/common.cpp", "tools/server/s.cpp", "vendor/x/y.h", "tests/t.cpp", "examples/e.cpp"):
        assert not prep.wanted(rel, ["cpu", "cuda", "vulkan"])


def test_a_local_tree_is_copied_patched_and_left_alone_when_unchanged(tmp_path):
    src = fake_tree(tmp_path / "upstream")
    dest = tmp_path / "prepared"
    patches = patch_dir(tmp_path, GOOD)
    assert run("--dest", dest, "--patches", patches, "--local-tree", src).returncode == 0
    assert (dest / "src/llama-context.cpp").read_text() == "int a = 2;\n"
    assert (src / "src/llama-context.cpp").read_text() == "int a = 1;\n"  # the given tree is never modified
    assert not (dest / "common").exists() and not (dest / "ggml/src/ggml-cuda").exists()
    stamp = (dest / "src/llama-context.cpp").stat().st_mtime_ns
    assert run("--dest", dest, "--patches", patches, "--local-tree", src).returncode == 0
    assert (dest / "src/llama-context.cpp").stat().st_mtime_ns == stamp  # no re-extraction, no rebuild
    assert run("--dest", dest, "--patches", patches, "--local-tree", src, "--backends", "cuda").returncode == 0
    assert (dest / "ggml/src/ggml-cuda/x.cu").exists()


EVERY_BACKEND = """diff --git a/ggml/src/ggml-cpu/ops.cpp b/ggml/src/ggml-cpu/ops.cpp
--- a/ggml/src/ggml-cpu/ops.cpp
+++ b/ggml/src/ggml-cpu/ops.cpp
@@ -0,0 +1 @@
+int cpu_kernel;
diff --git a/ggml/src/ggml-cuda/x.cu b/ggml/src/ggml-cuda/x.cu
--- a/ggml/src/ggml-cuda/x.cu
+++ b/ggml/src/ggml-cuda/x.cu
@@ -0,0 +1 @@
+int cuda_kernel;
"""


def test_a_patch_of_every_backend_applies_to_a_tree_without_some(tmp_path):
    src = fake_tree(tmp_path / "upstream")
    patches = patch_dir(tmp_path, EVERY_BACKEND)
    dest = tmp_path / "prepared"
    assert run("--dest", dest, "--patches", patches, "--local-tree", src).returncode == 0
    assert (dest / "ggml/src/ggml-cpu/ops.cpp").read_text() == "int cpu_kernel;\n"
    assert not (dest / "ggml/src/ggml-cuda").exists()
    assert run("--dest", dest, "--patches", patches, "--local-tree", src, "--backends", "cuda").returncode == 0
    assert (dest / "ggml/src/ggml-cuda/x.cu").read_text() == "int cuda_kernel;\n"
    # a patch of one backend alone is left out of a tree without it, and applied to one with it
    cuda_only = EVERY_BACKEND[EVERY_BACKEND.index("diff --git a/ggml/src/ggml-cuda") :]
    (patches / "0002-cuda-kernel.patch").write_text("Subject: a CUDA kernel\n\nWhat: ... Why: ...\n\n" + cuda_only)
    dest2 = tmp_path / "prepared-cpu"
    assert run("--dest", dest2, "--patches", patches, "--local-tree", src).returncode == 0
    assert not (dest2 / "ggml/src/ggml-cuda").exists()


def test_a_new_patch_replaces_only_the_files_it_changes(tmp_path):
    src = fake_tree(tmp_path / "upstream")
    patches = patch_dir(tmp_path, GOOD)
    dest = tmp_path / "prepared"
    assert run("--dest", dest, "--patches", patches, "--local-tree", src, "--backends", "cuda").returncode == 0
    untouched = (dest / "src/llama-context.cpp").stat().st_mtime_ns
    (patches / "0002-kernel.patch").write_text("What: Why:\n\n" + EVERY_BACKEND)
    assert run("--dest", dest, "--patches", patches, "--local-tree", src).returncode == 0
    assert (dest / "src/llama-context.cpp").stat().st_mtime_ns == untouched
    assert (dest / "src/llama-context.cpp").read_text() == "int a = 2;\n"
    assert (dest / "ggml/src/ggml-cpu/ops.cpp").read_text() == "int cpu_kernel;\n"
    assert not (dest / "ggml/src/ggml-cuda").exists()  # the backend left out is gone, folder and all
    assert not (tmp_path / "prepared.preparing").exists()


def test_a_patch_that_does_not_apply_stops_with_its_name(tmp_path):
    src = fake_tree(tmp_path / "upstream")
    patches = patch_dir(tmp_path, GOOD.replace("int a = 1;", "int b = 7;"))
    done = run("--dest", tmp_path / "prepared", "--patches", patches, "--local-tree", src)
    assert done.returncode == 1
    assert "0001-change.patch does not apply" in done.stderr


def test_patches_can_be_left_out_and_the_series_hash_follows(tmp_path):
    d = patch_dir(tmp_path, GOOD)
    (d / "0002-other.patch").write_text("x")
    full = prep.patch_series(d, set())
    assert [p.name for p in full] == ["0001-change.patch", "0002-other.patch"]
    assert [p.name for p in prep.patch_series(d, {"0002"})] == ["0001-change.patch"]
    assert prep.series_hash(full) != prep.series_hash(full[:1])


def test_a_cached_sdist_with_the_wrong_hash_is_not_used(tmp_path, monkeypatch):
    (tmp_path / prep.SDIST_FILE).write_bytes(b"not the sdist")
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="offline")

    monkeypatch.setattr(prep.subprocess, "run", fake_run)
    with pytest.raises(prep.PrepareError, match="could not fetch"):
        prep.fetch_sdist(tmp_path)
    assert calls and calls[0][1:4] == ["-m", "pip", "download"]


def test_the_repository_tracks_no_upstream_file():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    upstream = [
        p for p in tracked if p.startswith(("ggml/", "src/", "include/", "common/")) or p.endswith((".cu", ".metal"))
    ]
    assert upstream == []
    # vendor/ holds our own files only: the series, the script that applies it, its README, and the
    # export list the GPU backends are linked with
    ours = ("vendor/patches/", "vendor/prepare_llama_cpp.py", "vendor/README", "vendor/backend-exports.map")
    assert [p for p in tracked if p.startswith("vendor/") and not p.startswith(ours)] == []
