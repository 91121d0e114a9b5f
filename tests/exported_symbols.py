"""What a built library exports that belongs to the C++ runtime: a second copy of libstdc++'s state.

A shared library that exports a symbol libstdc++.so.6 also defines can take that symbol over for
the whole process (ELF interposition; STB_GNU_UNIQUE symbols, such as the facet ids of
std::locale and their guard variables, bind process-wide to the first definition loaded). Then
libstdc++'s own code and code in other libraries disagree about the runtime's state, and whether
the process survives depends on the order its libraries were loaded: std::regex, reached by the
tokenizer at model load, read a facet index that libstdc++ never registered and crashed.

The one kind of shared symbol allowed is a weak function (nm type W): an inline or template
function's vague-linkage copy, the same code as libstdc++'s. Anything else libstdc++ defines
(its data, its unique objects, its vtables and type info, its strong functions) must not be
exported by a library of ours.

Usage: python tests/exported_symbols.py DIR_OR_LIB [...]  (exit 1 with the offenders listed)
       python tests/exported_symbols.py --installed    (the libraries of the retro this Python imports)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

# nm's type letter of a weak function: vague linkage, identical code wherever it is emitted
HARMLESS_TYPES = frozenset("Ww")


def _defined_dynamic(library: Path) -> dict[str, str]:
    """{mangled name without its version: nm type letter} of what the library exports."""
    nm = shutil.which("nm")
    if nm is None:
        raise RuntimeError("nm (GNU binutils) is not on PATH")
    out = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    symbols: dict[str, str] = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3:
            symbols[parts[2].split("@", 1)[0]] = parts[1]
    return symbols


def libstdcxx_path() -> Path:
    """The libstdc++.so.6 the C++ compiler links against (the runtime every library here loads)."""
    for compiler in ("c++", "g++"):
        exe = shutil.which(compiler)
        if exe:
            found = subprocess.run([exe, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True)
            path = Path(found.stdout.strip())
            if found.returncode == 0 and path.is_absolute() and path.is_file():
                return path.resolve()
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        if line.strip().startswith("libstdc++.so.6 ") and "=>" in line:
            return Path(line.split("=>", 1)[1].strip()).resolve()
    raise RuntimeError("libstdc++.so.6 not found (no C++ compiler on PATH and none in ldconfig's cache)")


def _demangle(names: list[str]) -> list[str]:
    filt = shutil.which("c++filt")
    if filt is None or not names:
        return names
    return subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()


def runtime_clashes(library: Path, runtime: dict[str, str]) -> list[str]:
    """Each symbol the library exports that libstdc++ also defines and that is not a weak function,
    as 'TYPE demangled-name'."""
    ours = _defined_dynamic(library)
    clashing = sorted(name for name, kind in ours.items() if name in runtime and kind not in HARMLESS_TYPES)
    return [f"{ours[name]} {pretty}" for name, pretty in zip(clashing, _demangle(clashing))]


def shared_libraries(paths: Iterable[Path]) -> list[Path]:
    """The ELF shared objects named or found under the given folders (CMake's own scratch skipped)."""
    found: list[Path] = []
    for path in paths:
        if path.is_file():
            found.append(path)
            continue
        for lib in sorted(path.rglob("*.so*")):
            if lib.is_file() and not lib.is_symlink() and "CMakeFiles" not in lib.parts and _is_elf(lib):
                found.append(lib)
    return found


def installed_libraries() -> Path:
    """The folder of the extension of the retro this interpreter imports (run as a script, this
    file's folder, not the working directory, leads sys.path: a source checkout's retro/ is not it)."""
    import retro._native

    return Path(retro._native.__file__).resolve().parent


def _is_elf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"\x7fELF"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv == ["--installed"]:
        argv = [str(installed_libraries())]
    libraries = shared_libraries(Path(a) for a in argv)
    if not libraries:
        print(f"exported_symbols: no shared library under {' '.join(argv)}", file=sys.stderr)
        return 2
    stdcxx = libstdcxx_path()
    runtime = _defined_dynamic(stdcxx)
    bad = 0
    for lib in libraries:
        clashes = runtime_clashes(lib, runtime)
        bad += bool(clashes)
        print(f"{lib}: {len(clashes)} symbol(s) of {stdcxx.name} exported")
        for line in clashes[:40]:
            print(f"    {line}")
        if len(clashes) > 40:
            print(f"    ... and {len(clashes) - 40} more")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
