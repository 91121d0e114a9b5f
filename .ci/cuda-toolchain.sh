# Sourced by .ci/compile-cuda and .ci/certify-cuda: what CMake needs to build ggml-cuda with the
# nvcc on PATH, as NAME=VALUE lines in the array cuda_defines (callers spell them -D or
# -Ccmake.define.). A toolkit without cuBLAS takes it from elsewhere on the disk (a pip-installed
# nvidia-cublas, for one) or, where the network allows (CUDA_FETCH_CUBLAS=1), from NVIDIA's
# nvidia-cublas wheel, unpacked under build/ and never installed; a machine with no driver library
# links against an empty stand-in (a shared library may leave the driver's symbols to the loader).
cuda_nvcc=${CUDACXX:-$(command -v nvcc || true)}
[[ -n "$cuda_nvcc" ]] || { echo "cuda-toolchain: no nvcc on PATH (set CUDACXX)" >&2; exit 2; }
# the real compiler's folder, also behind a wrapper script such as /usr/local/bin/nvcc
cuda_top=$("$cuda_nvcc" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
cuda_toolkit=$(readlink -f "${cuda_top:-$(dirname "$(readlink -f "$cuda_nvcc")")/..}")
cuda_major=$("$cuda_nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
cuda_arch="${CUDA_ARCH:-90}"
cuda_deps="${CUDA_DEPS:-build/cuda-deps}"
echo "cuda-toolchain: nvcc $("$cuda_nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p') in $cuda_toolkit, sm_$cuda_arch"
cuda_defines=("CMAKE_CUDA_ARCHITECTURES=$cuda_arch" "CMAKE_CUDA_COMPILER=$cuda_nvcc" "CUDAToolkit_ROOT=$cuda_toolkit")

if ! compgen -G "$cuda_toolkit/include/cublas_v2.h" >/dev/null &&
  ! compgen -G "$cuda_toolkit/targets/*/include/cublas_v2.h" >/dev/null; then
  # where a cuBLAS outside the toolkit lives: unpacked here before, a Python environment's
  # nvidia-cublas, another install under /usr/local or /opt; only one of this toolkit's major version
  places=("$cuda_deps" $(python3 -c 'import site; print(" ".join(site.getsitepackages()))') /usr/local /opt)
  cublas_h=""
  for header in $(find "${places[@]}" -name cublas_v2.h 2>/dev/null || true); do
    if grep -qs "define CUBLAS_VER_MAJOR $cuda_major\b" "$(dirname "$header")/cublas_api.h"; then
      cublas_h=$header
      break
    fi
  done
  if [[ -z "$cublas_h" && "${CUDA_FETCH_CUBLAS:-0}" = 1 ]]; then
    mkdir -p "$cuda_deps/wheels"
    compgen -G "$cuda_deps/wheels/nvidia_cublas-$cuda_major.*.whl" >/dev/null ||
      python3 -m pip download -q --no-deps --only-binary=:all: -d "$cuda_deps/wheels" \
        "nvidia-cublas>=$cuda_major,<$((cuda_major + 1))"
    python3 -m zipfile -e "$(ls "$cuda_deps"/wheels/nvidia_cublas-"$cuda_major".*.whl | head -n 1)" "$cuda_deps"
    cublas_h="$cuda_deps/nvidia/cu$cuda_major/include/cublas_v2.h"
  fi
  [[ -n "$cublas_h" && -f "$cublas_h" ]] || { echo "cuda-toolchain: no cuBLAS $cuda_major for this toolkit" >&2; exit 2; }
  cublas=$(dirname "$(dirname "$(readlink -f "$cublas_h")")")
  lib=$(find "$cublas" -name 'libcublas.so.*' | head -n 1)
  lib_lt=$(find "$cublas" -name 'libcublasLt.so.*' | head -n 1)
  [[ -n "$lib" && -n "$lib_lt" ]] || { echo "cuda-toolchain: $cublas has cuBLAS's headers, not its libraries" >&2; exit 2; }
  cuda_defines+=("CUDA_cublas_LIBRARY=$(readlink -f "$lib")" "CUDA_cublasLt_LIBRARY=$(readlink -f "$lib_lt")"
    "CMAKE_CUDA_FLAGS=-I$cublas/include")
  echo "cuda-toolchain: cuBLAS from $cublas"
fi
if ! compgen -G "$cuda_toolkit/lib64/stubs/libcuda.so" >/dev/null &&
  ! compgen -G "$cuda_toolkit/targets/*/lib/stubs/libcuda.so" >/dev/null; then
  # ldconfig is in /sbin, off a non-root user's PATH on Debian; the x86-64 entry, not an i386 one
  driver=$({ ldconfig -p || /sbin/ldconfig -p; } 2>/dev/null | sed -n 's/.*libcuda\.so\.1 (libc6,x86-64.*=> //p' | head -n 1 || true)
  if [[ -z "$driver" ]]; then
    mkdir -p "$cuda_deps/stubs"
    echo | cc -shared -x c - -o "$cuda_deps/stubs/libcuda.so" -Wl,-soname,libcuda.so.1
    driver=$(readlink -f "$cuda_deps/stubs/libcuda.so")
    echo "cuda-toolchain: an empty libcuda.so stands in for the driver at link time"
  fi
  cuda_defines+=("CUDA_cuda_driver_LIBRARY=$driver")
fi
