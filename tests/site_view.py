"""An interpreter environment that sees a separately built retro and not the editable install.

Run with ``python -S`` (no .pth processing, so the editable install's import hook is never set up)
and the returned PYTHONPATH: the build first, then a view of this interpreter's site-packages
without retro itself, without .pth files and without old backports of standard-library modules
(such as the PyPI ``typing``), which would shadow the standard library from PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path


def _hidden(name: str) -> bool:
    stem = name.split(".", 1)[0].split("-", 1)[0]
    return (
        name.endswith(".pth")
        or stem.startswith(("retro", "_retro", "__editable__", "__pycache__"))
        or stem in sys.stdlib_module_names
    )


def site_view_env(build: Path, view: Path) -> dict[str, str]:
    view.mkdir(parents=True, exist_ok=True)
    for lib in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        for entry in Path(lib).iterdir():
            link = view / entry.name
            if not _hidden(entry.name) and not link.exists():
                link.symlink_to(entry)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(build), str(view)]), PYTHONNOUSERSITE="1")


def build_into(target: Path, build_dir: Path, *defines: str, env: dict[str, str] | None = None) -> None:
    """pip-install retro from this checkout into `target` (a folder of its own, no dependencies),
    built in `build_dir` (kept between runs: rebuilds are incremental) with CMake `defines`
    (NAME=VALUE). Asserts the build succeeded, with the end of its output."""
    repo = Path(__file__).resolve().parent.parent
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            str(target),
            f"-Cbuild-dir={build_dir}",
            *(f"-Ccmake.define.{d}" for d in defines),
            str(repo),
        ],
        capture_output=True,
        text=True,
        env=env if env is not None else dict(os.environ),
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
