#!/usr/bin/env bash
# Build the Go components of the local cluster from their upstream modules, pinned in hack/versions.env.
#
#   hack/build.sh [COMPONENT...]     components: k8s etcd kwok jobset helm kueue (default: all but kueue)
#
# Each component has a tiny go.mod under hack/<component>/ (its `tool` lines name the commands to build;
# go.sum is committed). Binaries go to hack/bin/<component>-<version>/ (ignored), which is reused as long
# as the version and go.mod are unchanged; the Go build cache (~/.cache/go-build) is kept between runs.
# Stable links for people and scripts: hack/bin/{kubectl,kwokctl,helm,kube-apiserver,...}.
# Cold build seconds per component are appended to hack/bin/logs/build-times.tsv.
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BIN="$HACK/bin"
# shellcheck source=versions.env
source "$HACK/versions.env"

# Go from the official tarball lives in /usr/local/go/bin, which a non-login shell may not have on PATH.
if ! command -v go >/dev/null && [ -x /usr/local/go/bin/go ]; then export PATH="/usr/local/go/bin:$PATH"; fi
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
export PYTHONSAFEPATH=1
export GOFLAGS="${GOFLAGS:--buildvcs=false}"
# Builds share 2 cores with everything else; one component at a time, go's own -p for packages.
GO_P="${GO_P:-$(nproc)}"

log() { printf '[build] %s\n' "$*" >&2; }

version_of() {
  case "$1" in
    k8s) echo "$KUBERNETES_VERSION" ;;
    etcd) echo "$ETCD_VERSION" ;;
    kwok) echo "$KWOK_VERSION" ;;
    jobset) echo "$JOBSET_VERSION" ;;
    helm) echo "$HELM_VERSION" ;;
    kueue) echo "$KUEUE_VERSION" ;;
    *) echo "unknown component: $1" >&2; return 2 ;;
  esac
}

# Cold build seconds on 2 cores (hack/bin/logs/build-times.tsv of a quiet machine), for the progress lines;
# none for the quick ones.
cold_seconds_of() {
  case "$1" in
    k8s) echo 863 ;;
    etcd) echo 44 ;;
    kwok) echo 202 ;;
    jobset) echo 222 ;;
    *) echo "" ;;
  esac
}

module_of() {
  case "$1" in
    k8s) echo k8s.io/kubernetes ;;
    etcd) echo go.etcd.io/etcd/server/v3 ;;
    kwok) echo sigs.k8s.io/kwok ;;
    jobset) echo sigs.k8s.io/jobset ;;
    helm) echo helm.sh/helm/v3 ;;
    kueue) echo sigs.k8s.io/kueue ;;
  esac
}

ldflags_of() {
  local c=$1 v=$2 f="-s -w"
  case "$c" in
    k8s)
      local minor="${v#v1.}"; minor="${minor%%.*}"
      for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        f+=" -X $p.gitVersion=$v -X $p.gitMajor=1 -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
        f+=" -X $p.buildDate=1970-01-01T00:00:00Z"
      done ;;
    helm) f+=" -X helm.sh/helm/v3/internal/version.version=$v" ;;
    jobset) f+=" -X sigs.k8s.io/jobset/pkg/version.GitVersion=$v" ;;
    kueue) f+=" -X sigs.k8s.io/kueue/pkg/version.GitVersion=$v" ;;
  esac
  echo "$f"
}

# Point go.mod at the pinned version (and, for k8s, its staging modules at the matching v0.x tag).
sync_gomod() {
  local c=$1 v=$2 mod; mod="$(module_of "$c")"
  local dir="$HACK/$c"
  local cur
  cur="$(cd "$dir" && go mod edit -json | python3 -c 'import json,sys; m=sys.argv[1]; print(next((r["Version"] for r in json.load(sys.stdin).get("Require") or [] if r["Path"] == m), ""))' "$mod")"
  if [ "$cur" = "$v" ]; then return 0; fi
  log "$c: pinning $mod $v in hack/$c/go.mod"
  (cd "$dir" && go mod edit -require="$mod@$v")
  if [ "$c" = k8s ]; then
    local sv="v0.${v#v1.}"
    for m in $(cd "$dir" && go mod edit -json | python3 -c 'import json,sys; [print(r["Old"]["Path"]) for r in json.load(sys.stdin).get("Replace") or []]'); do
      (cd "$dir" && go mod edit -replace="$m=$m@$sv")
    done
  elif [ "$c" = etcd ]; then
    for m in go.etcd.io/etcd/api/v3 go.etcd.io/etcd/client/pkg/v3 go.etcd.io/etcd/client/v3 go.etcd.io/etcd/pkg/v3; do
      (cd "$dir" && go mod edit -replace="$m=$m@$v")
    done
  fi
  (cd "$dir" && go mod tidy)
}

build_one() {
  local c=$1 v; v="$(version_of "$c")"
  local out="$BIN/$c-$v" key
  key="$(cat "$HACK/$c/go.mod" "$HACK/$c/go.sum" 2>/dev/null | sha1sum | cut -c1-12)"
  if [ -f "$out/.complete" ] && [ "$(cat "$out/.complete")" = "$key" ]; then
    return 0
  fi
  sync_gomod "$c" "$v"
  key="$(cat "$HACK/$c/go.mod" "$HACK/$c/go.sum" | sha1sum | cut -c1-12)"
  local tools
  tools="$(cd "$HACK/$c" && go mod edit -json | python3 -c 'import json,sys; [print(t["Path"]) for t in json.load(sys.stdin).get("Tool") or []]')"
  local expect; expect="$(cold_seconds_of "$c")"
  log "$c $v: building $(echo "$tools" | tr '\n' ' ')(${expect:+a cold build takes ~${expect}s on 2 cores; }log: hack/bin/logs/$c.log)"
  mkdir -p "$out" "$BIN/logs"
  local start; start=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$HACK/$c" && go build -p "$GO_P" -trimpath -ldflags="$(ldflags_of "$c" "$v")" -o "$out/" $tools) \
      >"$BIN/logs/$c.log" 2>&1 &
  local pid=$! ticks=0
  # A line a minute while it builds, so a long cold build shows it is alive.
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1; ticks=$((ticks + 1))
    if [ $((ticks % 60)) -eq 0 ]; then
      log "$c $v: still building, $(( $(date +%s) - start ))s so far${expect:+ (cold ~${expect}s)}"
    fi
  done
  if ! wait "$pid"; then
    tail -30 "$BIN/logs/$c.log" >&2
    log "$c $v: build FAILED"
    return 1
  fi
  # etcd's main package is the module root: name the binary etcd.
  if [ "$c" = etcd ] && [ -f "$out/server" ]; then mv "$out/server" "$out/etcd"; fi
  if [ "$c" = jobset ] && [ -f "$out/jobset" ]; then mv "$out/jobset" "$out/jobset-manager"; fi
  local secs=$(( $(date +%s) - start ))
  printf '%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$c" "$v" "$secs" >> "$BIN/logs/build-times.tsv"
  log "$c $v: built in ${secs}s"
  echo "$key" > "$out/.complete"
}

link_all() {
  local c v f
  for c in k8s etcd kwok jobset helm kueue; do
    v="$(version_of "$c")"
    [ -f "$BIN/$c-$v/.complete" ] || continue
    for f in "$BIN/$c-$v"/*; do
      [ -x "$f" ] && ln -sfn "$c-$v/$(basename "$f")" "$BIN/$(basename "$f")"
    done
  done
}

main() {
  local comps=("$@")
  if [ ${#comps[@]} -eq 0 ]; then comps=(k8s etcd kwok jobset helm); fi
  if [ "${comps[0]}" = all ]; then comps=(k8s etcd kwok jobset helm kueue); fi
  command -v go >/dev/null || { echo "go not found on PATH (needs Go >= 1.26)" >&2; exit 1; }
  # One build at a time into hack/bin (test sessions and `make cluster-up` may start together).
  mkdir -p "$BIN"; exec 8>"$BIN/.build.lock"; flock 8
  local c
  for c in "${comps[@]}"; do build_one "$c"; done
  link_all
}

main "$@"
