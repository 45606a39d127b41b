#!/usr/bin/env bash
# Run the test suite against Redis 6.0 (the oldest Redis floodgate supports) instead of the
# redis-server on the PATH: builds upstream Redis 6.0.16 once, from Debian's copy of its release
# tarball (checked against its SHA-256), into .cache/, then runs `vitest run` with that
# redis-server first on the PATH. Arguments go to vitest (default: every suite).
#
#   npm run test:redis6                          # everything, about 10 minutes
#   npm run test:redis6 -- test/redis test/contract
#
# Needs curl, make and a C compiler. REDIS_URL and REDIS_CLUSTER_NODES are unset, so every suite
# starts its own servers (and its Cluster) from the 6.0 binary; redis-cli is the PATH's own.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

version=6.0.16
sha256=8bea58a468bb67bedc92d8c2e44c170e42e6ea02527cbc5d233e92e8d78d1b99
url="https://deb.debian.org/debian/pool/main/r/redis/redis_${version}.orig.tar.gz"
cache="$PWD/.cache/redis-$version"
bin="$cache/bin"

if [ ! -x "$bin/redis-server" ]; then
  echo "building Redis $version into $cache (once)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  curl -fsSL --retry 3 -o "$work/redis.tar.gz" "$url"
  echo "$sha256  $work/redis.tar.gz" | sha256sum -c --quiet -
  tar -xzf "$work/redis.tar.gz" -C "$work"
  make -C "$work/redis-$version" -j"$(nproc)" MALLOC=libc BUILD_TLS=no >"$work/build.log" 2>&1 ||
    { tail -n 40 "$work/build.log"; exit 1; }
  mkdir -p "$bin"
  cp "$work/redis-$version/src/redis-server" "$bin/redis-server"
fi

"$bin/redis-server" --version
unset REDIS_URL REDIS_CLUSTER_NODES
PATH="$bin:$PATH" npx vitest run "$@"
