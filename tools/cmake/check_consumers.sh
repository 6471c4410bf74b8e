#!/usr/bin/env bash
# Builds and runs examples/consumer/main.cpp the three ways a user without
# Bazel would, against gdr installed into a scratch prefix:
#   1. find_package(gdr REQUIRED COMPONENTS core cuda verbs) (examples/cmake_consumer);
#   2. add_subdirectory of the source tree (the same project, GDR_CONSUMER_FROM_SOURCE);
#   3. a plain compile: g++ main.cpp $(pkg-config --cflags --libs gdr gdr-cuda gdr-verbs).
# Prints one "[cmake-consumer] <way>: PASSED|FAILED" line per way; exit status
# is the number that failed. Needs cmake and pkg-config (./bazelw installs them).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=0

check() {  # name log command...
  local name=$1 log=$2
  shift 2
  if "$@" >"$log" 2>&1; then
    echo "[cmake-consumer] $name: PASSED"
  else
    echo "[cmake-consumer] $name: FAILED; its output:"
    sed 's/^/  /' "$log"
    failed=$((failed + 1))
  fi
}

install_gdr() {
  cmake -S "$root" -B "$work/gdr-build" &&
    cmake --install "$work/gdr-build" --prefix "$work/prefix"
}
installed() {
  cmake -S "$root/examples/cmake_consumer" -B "$work/c1" -DCMAKE_PREFIX_PATH="$work/prefix" &&
    cmake --build "$work/c1" && "$work/c1/app"
}
from_source() {
  cmake -S "$root/examples/cmake_consumer" -B "$work/c2" -DGDR_CONSUMER_FROM_SOURCE=ON &&
    cmake --build "$work/c2" && "$work/c2/app"
}
pkg_config() {
  local flags
  flags=$(PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig" pkg-config --cflags --libs gdr gdr-cuda gdr-verbs) &&
    echo "pkg-config: $flags" &&
    ${CXX:-g++} -Wall -Wextra -Wundef -Werror "$root/examples/consumer/main.cpp" $flags -o "$work/app3" &&
    "$work/app3"
}

check install "$work/install.log" install_gdr
if [[ -d $work/prefix ]]; then
  check find_package "$work/installed.log" installed
  check pkg-config "$work/pkg.log" pkg_config
else
  echo "[cmake-consumer] find_package: FAILED (not run: the install failed)"
  echo "[cmake-consumer] pkg-config: FAILED (not run: the install failed)"
  failed=$((failed + 2))
fi
check add_subdirectory "$work/source.log" from_source
exit "$failed"
