# shellcheck shell=bash
# Set-up shared by scripts/run and scripts/test: a .venv built from the hashed lock, with
# llama-cpp-python compiled once per (version, sdist hash, build flags) and cached outside the repo.
# Sourced, not executed. Idempotent: a second run only checks stamps.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv"
LOCK="$ROOT/requirements.lock"
CACHE="${APPLIANCE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/appliance}"
PY="${APPLIANCE_PYTHON:-python3.11}"

# The portable llama.cpp build (FACTS.md): no -march=native, no AMX path; the image runs on other boxes.
# AVX2 is the ceiling, not AVX-512: a build with GGML_AVX512=ON dies with SIGILL on the first call
# on a CPU without it (many AMD EPYC parts), and the runtime's probe refuses such a build.
# GGML_OPENMP=OFF: ggml's own thread pool instead of OpenMP. With OpenMP, two threads of one
# process that both run multi-threaded calls (two pool workers) slow each other ~3x; without it
# they do not, and single calls are as fast (bench/RESULTS.md, "inference").
LLAMA_CMAKE_ARGS="${APPLIANCE_LLAMA_CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF}"

log() { printf '[setup] %s\n' "$*" >&2; }

ensure_python() {
  if ! command -v "$PY" >/dev/null 2>&1; then
    if command -v python3 >/dev/null 2>&1 && python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=python3
    else
      log "Python 3.11 is required (set APPLIANCE_PYTHON to its path)"; exit 1
    fi
  fi
}

# The lock's llama-cpp-python line (an sdist pinned by hash) is built separately; everything else
# installs with --require-hashes straight from the lock.
llama_requirement() {
  awk '/^llama-cpp-python==/{p=1} p{print} p && !/\\$/{exit}' "$LOCK"
}

llama_wheel_dir() {
  local key
  key="$(printf '%s\n%s\n' "$(llama_requirement)" "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-16)"
  printf '%s/wheels/llama-cpp-python-%s' "$CACHE" "$key"
}

build_llama_wheel() {
  local dir req
  dir="$(llama_wheel_dir)"
  if compgen -G "$dir/llama_cpp_python-*.whl" >/dev/null; then
    return 0
  fi
  log "building llama-cpp-python once (about 10 minutes on 2 cores) into $dir"
  mkdir -p "$dir.tmp"
  req="$(mktemp)"
  llama_requirement >"$req"
  # --no-cache-dir: pip's own wheel cache is keyed by the sdist alone, not by CMAKE_ARGS, and
  # would hand back a wheel built with other flags.
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$VENV/bin/pip" wheel --quiet --no-cache-dir --no-deps --require-hashes \
    --no-binary llama-cpp-python \
    -r "$req" -w "$dir.tmp"
  rm -f "$req"
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
}

ensure_venv() {
  ensure_python
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.installed" want
  want="$(cat "$LOCK" "$ROOT/pyproject.toml" | sha256sum | cut -c1-32)-$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-8)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  mkdir -p "$CACHE/pip"
  export PIP_CACHE_DIR="$CACHE/pip" PIP_DISABLE_PIP_VERSION_CHECK=1
  local rest
  rest="$(mktemp)"
  awk '/^llama-cpp-python==/{skip=1; next} skip && /^[[:space:]]/{next} {skip=0; print}' "$LOCK" >"$rest"
  log "installing the locked dependencies"
  "$VENV/bin/pip" install --quiet --require-hashes --no-deps -r "$rest"
  rm -f "$rest"
  build_llama_wheel
  "$VENV/bin/pip" install --quiet --no-deps --force-reinstall "$(llama_wheel_dir)"/llama_cpp_python-*.whl
  "$VENV/bin/pip" install --quiet --no-deps --no-build-isolation -e "$ROOT"
  printf '%s' "$want" >"$stamp"
}

# The PostgreSQL server binaries (the local cluster manager runs them). Installed with apt when
# missing and we are root; otherwise say exactly what to install.
ensure_postgres() {
  # Both spellings the settings read (APPLIANCE_DB__URL is APPLIANCE_DATABASE_URL's nested
  # name): an external server needs no server package here.
  if [ -n "${APPLIANCE_DATABASE_URL:-}${APPLIANCE_DB__URL:-}" ] \
     || [ -n "${APPLIANCE_PG_BINDIR:-}${APPLIANCE_DB__PG_BINDIR:-}" ]; then
    return 0
  fi
  if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    return 0
  fi
  # Where the appliance looks first (appliance/db/cluster.py find_bindir): a server installed
  # elsewhere needs no Debian package (which would also create and start a cluster of its own).
  if command -v pg_config >/dev/null 2>&1; then
    local bindir
    bindir="$(pg_config --bindir 2>/dev/null || true)"
    if [ -x "$bindir/initdb" ] && [ -x "$bindir/pg_ctl" ] && [ -x "$bindir/postgres" ]; then
      return 0
    fi
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing PostgreSQL server binaries (Debian package postgresql)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  else
    log "PostgreSQL server binaries not found: install the Debian package 'postgresql'"
    log "(apt-get install -y postgresql) or set APPLIANCE_PG_BINDIR to their folder"
    exit 1
  fi
}

# The pinned models of models.lock, fetched once into the model cache outside the repo (keyed by
# sha256) and verified; a second run only re-hashes the cached files.
ensure_models() {
  export APPLIANCE_MODEL_CACHE="${APPLIANCE_MODEL_CACHE:-$CACHE/models}"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/appliance" models fetch --all
}
