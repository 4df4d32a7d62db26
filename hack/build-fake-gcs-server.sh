#!/usr/bin/env bash
# Build fake-gcs-server (the GCS emulator the tests use, contract 6) from its Go module at the version
# pinned in hack/versions.env, into an ignored cache: .cache/fake-gcs-server/<version>/fake-gcs-server.
# Prints the binary's path. Idempotent: an existing binary is reused.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=/dev/null
source "$root/hack/versions.env"
version="${FAKE_GCS_SERVER_VERSION:?FAKE_GCS_SERVER_VERSION missing from hack/versions.env}"
dest="$root/.cache/fake-gcs-server/$version"
bin="$dest/fake-gcs-server"
if [[ ! -x "$bin" ]]; then
  command -v go >/dev/null || { echo "go not found: needed to build fake-gcs-server" >&2; exit 1; }
  mkdir -p "$dest"
  tmp="$(mktemp -d "$dest/.build.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  GOBIN="$tmp" CGO_ENABLED=0 go install "github.com/fsouza/fake-gcs-server@$version" >&2
  mv "$tmp/fake-gcs-server" "$bin"
fi
echo "$bin"
