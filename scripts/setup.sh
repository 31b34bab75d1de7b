#!/usr/bin/env bash
# The one set-up script. Both README commands (`scripts/meridian` and `scripts/test`) source it.
#
# It installs what the build needs on a fresh Debian machine of this kind, and exports the
# environment the build uses. It is idempotent and quiet when everything is already present.
#
#   clang, libclang-dev   bindgen inside librocksdb-sys generates RocksDB's C bindings
#   librocksdb-dev        RocksDB 7.8 from Debian, linked dynamically (see ARCHITECTURE.md, "RocksDB")
#   protobuf-compiler     protoc, for tonic/prost code generation
#   fuse3                 fusermount3, for the power-loss file system of the power-cut tests
#                         (integration/src/powercut; /dev/fuse must exist)
#   python3, python3-venv the stock Python Pulsar client (pulsar-client, from PyPI, in a venv
#                         under the cache folder) that the real-client tests drive
#   chromium              headless, for the test of the console page (/console)
#   libfaketime           clock jumps in the fault-schedule runner (integration/src/chaos/clock.rs)
set -euo pipefail

meridian_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

missing=()
command -v clang >/dev/null 2>&1 || missing+=(clang)
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
python3 -c "import ensurepip, venv" >/dev/null 2>&1 || missing+=(python3-venv)
for pkg in libclang-dev librocksdb-dev libsnappy-dev libfaketime; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get update -qq >&2
  # Waits for another apt (an unattended upgrade at boot) instead of failing at once.
  "${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

if ! command -v cargo >/dev/null 2>&1; then
  [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
fi

multiarch="$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"
export ROCKSDB_LIB_DIR="${ROCKSDB_LIB_DIR:-/usr/lib/$multiarch}"
export SNAPPY_LIB_DIR="${SNAPPY_LIB_DIR:-/usr/lib/$multiarch}"
# A build directory outside the clone, so CI runs and later sessions on this machine are incremental.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/meridian/target}"
export MERIDIAN_ROOT="$meridian_root"

# The stock Python client for the real-client tests, pinned, in a venv beside the build cache.
MERIDIAN_VENV="${MERIDIAN_VENV:-$HOME/.cache/meridian/venv}"
if ! "$MERIDIAN_VENV/bin/python" -c "import pulsar" >/dev/null 2>&1; then
  echo "setup: installing pulsar-client 3.13.0 into $MERIDIAN_VENV" >&2
  python3 -m venv "$MERIDIAN_VENV" >&2
  "$MERIDIAN_VENV/bin/pip" install -q "pulsar-client==3.13.0" >&2
fi
export MERIDIAN_VENV
export MERIDIAN_PYTHON="$MERIDIAN_VENV/bin/python"
