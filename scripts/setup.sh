#!/usr/bin/env bash
# One-command environment for grace_dl on a fresh Debian machine with Python 3.11:
#   Open MPI (Debian), .venv with torch / tensorflow-cpu / mpi4py / the project (editable),
#   and Horovod 0.28.1 built from its PyPI sdist with Gloo + MPI + PyTorch + TensorFlow.
# The Horovod wheel is cached outside the repo, keyed by what it was built against, so a
# second machine state with the cache present installs it in seconds. Re-running is a no-op
# when everything is already in place.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3.11}"
VENV="$ROOT/.venv"
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TRITON_VERSION=3.6.0     # the GPU machines' Triton; here its interpreter runs the kernels' tests
TF_VERSION=2.21.0
PATCH="$ROOT/scripts/horovod-${HOROVOD_VERSION}-cpu.patch"
CACHE_ROOT="${GRACE_DL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/grace_dl}"

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
die() { printf '\033[1;31m[setup] ERROR:\033[0m %s\n' "$*" >&2; exit 1; }

# The stamp records every input of a set-up; when it matches and the build check passes,
# there is nothing to do.
inputs_hash() {
  cat "$ROOT/scripts/setup.sh" "$PATCH" "$ROOT/pyproject.toml" "$ROOT/setup.py" \
    "$ROOT/scripts/constraints.txt" "$ROOT/grace_dl/native/kernels.c" | sha256sum | cut -c1-16
}
STAMP="$VENV/.grace_dl_setup"

check_build() {
  local out
  out="$("$VENV/bin/horovodrun" --check-build 2>&1)" || { echo "$out"; return 1; }
  local missing=()
  for want in TensorFlow PyTorch MPI Gloo; do
    grep -q "\[X\] $want" <<<"$out" || missing+=("$want")
  done
  if ((${#missing[@]})); then
    echo "$out"
    echo "horovodrun --check-build does not list as built: ${missing[*]}"
    return 1
  fi
  echo "$out"
}

# Fast path (no framework imports): the stamp matches and Horovod's torch and TF extensions are
# in place. The full `horovodrun --check-build` ran when the stamp was written.
hvd_built() {
  local site
  site="$(ls -d "$VENV"/lib/python3*/site-packages 2>/dev/null | head -1)"
  [[ -n "$site" ]] && ls "$site"/horovod/torch/mpi_lib_v2*.so "$site"/horovod/tensorflow/mpi_lib*.so \
    "$site"/horovod-${HOROVOD_VERSION}.dist-info >/dev/null 2>&1
}
# grace_dl's compiled kernels (built in place by `pip install -e`; gone after a `git clean`)
native_built() { ls "$ROOT"/grace_dl/native/_kernels*.so >/dev/null 2>&1; }
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(inputs_hash)" ]] && hvd_built && native_built; then
  log "environment up to date ($VENV); nothing to do"
  exit 0
fi

# ---------------------------------------------------------------- system packages
need_apt=()
dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
dpkg -s openmpi-bin >/dev/null 2>&1 || need_apt+=(openmpi-bin)
dpkg -s iproute2 >/dev/null 2>&1 || need_apt+=(iproute2)       # benchmarks' emulated hosts
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v make >/dev/null 2>&1 || need_apt+=(make)
if ((${#need_apt[@]})); then
  log "installing Debian packages: ${need_apt[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to apt-get install ${need_apt[*]}"
    SUDO=sudo
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" \
    || die "apt-get install ${need_apt[*]} failed"
fi

# ---------------------------------------------------------------- virtual environment
command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=/path/to/python3.11)"
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
export PIP_NO_INPUT=1
# Every install below is held to this machine's versions (torch's CPU build first of all).
CONSTRAINTS=(-c "$ROOT/scripts/constraints.txt")
grep -qx "torch==$TORCH_VERSION" "$ROOT/scripts/constraints.txt" \
  && grep -qx "tensorflow-cpu==$TF_VERSION" "$ROOT/scripts/constraints.txt" \
  || die "scripts/constraints.txt must pin torch==$TORCH_VERSION and tensorflow-cpu==$TF_VERSION"

log "installing torch==$TORCH_VERSION (CPU build; pinned exactly so no CUDA wheels are pulled)"
"${PIP[@]}" install "${CONSTRAINTS[@]}" "torch==$TORCH_VERSION"
log "installing tensorflow-cpu==$TF_VERSION, mpi4py (built against Debian's Open MPI), grace_dl"
log "and its test clients (lightning, accelerate; pinned in the dev extra)"
# mpi4py from source so that it links the same libmpi as Horovod (hvd.init(comm=...) needs that).
# The tensorflow extra names the `tensorflow` distribution; this machine runs tensorflow-cpu,
# the same package without GPU support, so it is installed by name instead of by the extra.
"${PIP[@]}" install "${CONSTRAINTS[@]}" --no-binary mpi4py "tensorflow-cpu==$TF_VERSION" \
  -e "$ROOT[torch,dev]"
log "installing triton==$TRITON_VERSION (the device path's kernels, tested in its interpreter)"
"${PIP[@]}" install "${CONSTRAINTS[@]}" "triton==$TRITON_VERSION"

# ---------------------------------------------------------------- Horovod
PYTAG="$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
MPITAG="$(dpkg-query -W -f='${Version}' libopenmpi-dev 2>/dev/null | tr -c 'A-Za-z0-9.\n' '_')"
PATCHTAG="$(sha256sum "$PATCH" | cut -c1-8)"
KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VERSION}_tf-${TF_VERSION}_${PYTAG}_openmpi-${MPITAG}_patch-${PATCHTAG}"
WHEEL_DIR="$CACHE_ROOT/wheels/$KEY"

installed_hvd="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("horovod"))' 2>/dev/null || true)"
if [[ "$installed_hvd" != "$HOROVOD_VERSION" ]] || ! check_build >/dev/null 2>&1; then
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION from the PyPI sdist (takes ~15-20 min on 2 cores)"
    log "cache key: $KEY"
    BUILD="$(mktemp -d)"
    trap 'rm -rf "$BUILD"' EXIT
    "${PIP[@]}" download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD"
    tar xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
    (cd "$BUILD/horovod-$HOROVOD_VERSION" && patch -p1 --quiet < "$PATCH") || die "patch $PATCH did not apply"
    mkdir -p "$WHEEL_DIR.tmp"
    # Build against the venv's torch and TF (no isolation): the wheel is ABI-bound to them.
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    MAKEFLAGS="-j$(nproc)" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$WHEEL_DIR.tmp" "$BUILD/horovod-$HOROVOD_VERSION" \
      > "$BUILD/build.log" 2>&1 || { tail -60 "$BUILD/build.log"; die "Horovod build failed (log above)"; }
    rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
    log "cached $(ls "$WHEEL_DIR")"
  else
    log "reusing cached Horovod wheel: $WHEEL_DIR"
  fi
  "${PIP[@]}" install --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
  "${PIP[@]}" install cloudpickle psutil pyyaml packaging cffi   # Horovod's runtime requirements
fi

log "checking horovodrun --check-build"
if ! out="$(check_build)"; then
  echo "$out" >&2
  die "Horovod is missing a framework or controller (see above)"
fi
echo "$out"
inputs_hash > "$STAMP"
log "done: activate with 'source .venv/bin/activate'"
