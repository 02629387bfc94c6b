#!/usr/bin/env bash
# Installs (Debian/Ubuntu apt) what building and running dpukv needs beyond the Rust toolchain:
# protoc (etcd-client's build), etcd (the metadata store of a multi-node cluster; the tests run a
# real one), libfabric's headers and library (the fabric transport: built against the headers,
# loaded at run time; a build without them has no fabric endpoints) and python3 (the dependency
# check). Extra package names can be passed as arguments.
set -euo pipefail
command -v cargo >/dev/null || { echo "cargo (Rust stable, 1.89 or newer) is required" >&2; exit 1; }
need=()
command -v python3 >/dev/null || need+=(python3)
command -v protoc >/dev/null || need+=(protobuf-compiler)
command -v etcd >/dev/null || need+=(etcd-server)
[ -f /usr/include/rdma/fabric.h ] || need+=(libfabric-dev)
for cmd_pkg in "$@"; do
  cmd=${cmd_pkg%%=*}; pkg=${cmd_pkg#*=}
  command -v "$cmd" >/dev/null || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
