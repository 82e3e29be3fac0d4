#!/usr/bin/env bash
# Builds llama.cpp's libraries (the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp) for AVX2 + FMA + F16C
# + BMI2 only, no AVX-512: the peer as a Zen 3 or an Intel client core runs it, on a host that has more.
# Pair it with moetier's AVX2 build on the same host:
#   lib=$(bash scripts/llama_cpp_avx2.sh)
#   MOETIER_ARCH=-march=x86-64-v3 LLAMA_CPP_LIB_PATH=$lib .venv/bin/python benchmarks/bench_decode.py --preset wide
#   MOETIER_ARCH=-march=x86-64-v3 .venv/bin/python benchmarks/bench_kernels.py --llama-cpu-lib $lib/libggml-cpu.so
# Prints the folder of the libraries (llama-cpp-python loads them from LLAMA_CPP_LIB_PATH). ~5 minutes on 2
# cores once; the build is kept under $MOETIER_HOME (default ~/.cache/moetier)/llama-cpp-avx2.
set -euo pipefail
version=0.3.36
root="${MOETIER_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/moetier}/llama-cpp-avx2"
src="$root/llama_cpp_python-$version/vendor/llama.cpp"
out="$src/build/bin"
if [ -f "$out/libllama.so" ]; then echo "$out"; exit 0; fi
python="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
mkdir -p "$root"
if [ ! -d "$src" ]; then
    "$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$root" >&2
    tar xzf "$root/llama_cpp_python-$version.tar.gz" -C "$root"
fi
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF >&2
cmake --build "$src/build" -j"$(nproc)" --target llama >&2
echo "$out"
