#!/usr/bin/env bash
# Installs the Debian packages kvstore's tests and benchmarks use, if missing.
# redis-server: benchmark peer; etcd-server: cluster membership; liburing-dev: io_uring headers;
# libibverbs1: Mooncake's wheel (make test-mooncake) links it even for TCP.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
[ -f /usr/include/liburing.h ] || need+=(liburing-dev)
[ -f /usr/include/xxhash.h ] || need+=(libxxhash-dev)
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || need+=(libibverbs1)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
    echo "install-system-deps: need root to apt-get install ${need[*]}" >&2; exit 1; fi
else SUDO=; fi
echo "install-system-deps: installing ${need[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
