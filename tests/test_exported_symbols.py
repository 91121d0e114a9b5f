"""No library of the build exports a second copy of the C++ runtime's state (tests/exported_symbols.py).

A CUDA build once exported libstdc++'s locale facet ids from libggml-cuda.so, and a process that
imported things in one order died in std::regex at model load. The same check runs on every build
CI makes (this one, the Vulkan build in .ci/run) and on the CUDA compile-only build
(.ci/compile-cuda)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from exported_symbols import _defined_dynamic, installed_libraries, libstdcxx_path, runtime_clashes, shared_libraries


@pytest.fixture(scope="module")
def runtime() -> dict[str, str]:
    return _defined_dynamic(libstdcxx_path())


def test_no_library_of_this_build_exports_libstdcxx_state(runtime):
    libraries = shared_libraries([installed_libraries()])
    names = sorted(lib.name for lib in libraries)
    # every library the binding loads is looked at, not only the ones that happen to be there
    for expected in ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so"):
        assert expected in names, f"{expected} not found beside the extension: {names}"
    assert any(name.startswith("_native") for name in names)
    found = {lib.name: runtime_clashes(lib, runtime) for lib in libraries}
    assert not any(found.values()), {name: lines[:10] for name, lines in found.items() if lines}


def test_the_check_finds_a_library_that_carries_its_own_libstdcxx(tmp_path, runtime):
    """A library linked with libstdc++'s static archive exports the archive's locale state (the way
    the CUDA library's clash looked); linked with its archives' symbols hidden it exports none."""
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx is not None, "a C++ compiler is needed to build the check's own defect"
    source = tmp_path / "probe.cpp"
    source.write_text(
        "#include <sstream>\n#include <string>\n"
        'extern "C" int probe(int a) { std::ostringstream s; s << a; return (int) s.str().size(); }\n'
    )
    carrying, hiding = tmp_path / "libcarrying.so", tmp_path / "libhiding.so"
    common = [cxx, "-shared", "-fPIC", "-O1", str(source), "-static-libstdc++"]
    subprocess.run([*common, "-o", str(carrying)], check=True)
    subprocess.run([*common, "-Wl,--exclude-libs,ALL", "-o", str(hiding)], check=True)
    clashes = runtime_clashes(carrying, runtime)
    # the clash the CUDA build had: unique facet ids (and their guard variables) of std::locale
    assert "u std::collate<char>::id" in clashes, clashes[:20]
    assert "u guard variable for std::moneypunct<char, false>::id" in clashes, clashes[:20]
    assert runtime_clashes(hiding, runtime) == []
