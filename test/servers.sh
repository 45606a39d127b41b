#!/usr/bin/env bash
# Run the test suite against another Redis-compatible server than the redis-server on the PATH:
# Redis 6.0 (the oldest floodgate supports), Redis 8.0 or Valkey 8.1. The server is built once,
# from Debian's copy of its upstream release tarball (checked against its SHA-256), into .cache/;
# then `vitest run` runs with that server first on the PATH as `redis-server`. Arguments after
# the server's name go to vitest (default: every suite).
#
#   npm run test:server -- redis-6.0                    # everything, about 10 minutes
#   npm run test:server -- valkey-8.1 test/redis test/contract
#
# Needs curl, make and a C compiler (a build takes 1 to 3 minutes on 2 cores). REDIS_URL and
# REDIS_CLUSTER_NODES are unset, so every suite starts its own servers (and its Cluster) from the
# binary built; redis-cli is the PATH's own.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

pool=https://deb.debian.org/debian/pool/main
case "${1:-}" in
  redis-6.0)
    tarball=$pool/r/redis/redis_6.0.16.orig.tar.gz
    sha256=8bea58a468bb67bedc92d8c2e44c170e42e6ea02527cbc5d233e92e8d78d1b99
    dir=redis-6.0.16 binary=redis-server ;;
  redis-8.0)
    tarball=$pool/r/redis/redis_8.0.2.orig.tar.gz
    sha256=caf3c0069f06fc84c5153bd2a348b204c578de80490c73857bee01d9b5d7401f
    dir=redis-8.0.2 binary=redis-server ;;
  valkey-8.1)
    tarball=$pool/v/valkey/valkey_8.1.1+dfsg1.orig.tar.xz
    sha256=d9bbd82eecb82f359e649a0007ad3dc1b47cc15afa626348ca86b73c4ae2c7ee
    dir=valkey-8.1.1 binary=valkey-server ;;
  *)
    echo "usage: npm run test:server -- <redis-6.0 | redis-8.0 | valkey-8.1> [vitest arguments]" >&2
    exit 2 ;;
esac
shift

bin="$PWD/.cache/$dir/bin"
if [ ! -x "$bin/redis-server" ]; then
  echo "building $dir into .cache/$dir (once)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  curl -fsSL --retry 3 -o "$work/source" "$tarball"
  echo "$sha256  $work/source" | sha256sum -c --quiet -
  tar -xf "$work/source" -C "$work"
  make -C "$work/$dir" -j"$(nproc)" BUILD_TLS=no >"$work/build.log" 2>&1 ||
    { tail -n 40 "$work/build.log"; exit 1; }
  mkdir -p "$bin"
  cp "$work/$dir/src/$binary" "$bin/redis-server"
fi

"$bin/redis-server" --version
unset REDIS_URL REDIS_CLUSTER_NODES
PATH="$bin:$PATH" npx vitest run "$@"
