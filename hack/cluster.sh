#!/usr/bin/env bash
# The local Kubernetes cluster: real kube-apiserver/controller-manager/scheduler/etcd run by kwokctl's
# `binary` runtime from the binaries hack/build.sh makes (nothing is downloaded), kwok nodes shaped like
# GKE TPU node pools (hack/cluster/nodes.py), kwok Stages that move pods (hack/cluster/stages.yaml), and
# the JobSet controller as a local process with its admission webhooks registered by URL; optionally
# the Kueue manager the same way (RLJOB_KUEUE=1 at `up`, or `kueue-up` on a running cluster).
#
#   hack/cluster.sh up        build what is missing, start (or reuse) the cluster, print `export KUBECONFIG=...`
#                             (RLJOB_KUEUE=1: Kueue too, built first if missing; RLJOB_JOBSET_RESTART_JOB_GATE=off:
#                             JobSet's feature gate RestartJob off, as JobSet ships it)
#   hack/cluster.sh down      stop everything this script started and delete the cluster's state
#   hack/cluster.sh status    exit 0 when the API server answers and the JobSet controller runs
#   hack/cluster.sh kueue-up  build Kueue if missing and start it on the running cluster (no-op if it runs)
#   hack/cluster.sh kueue-status  exit 0 when the cluster is up and Kueue runs
#   hack/cluster.sh kubeconfig  print the kubeconfig path
#
# State lives in $RLJOB_CLUSTER_DIR (default: <repo>/.cache/cluster, ignored by git).
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HACK")"
BIN="$HACK/bin"
# shellcheck source=versions.env
source "$HACK/versions.env"

STATE="${RLJOB_CLUSTER_DIR:-$REPO/.cache/cluster}"
NAME="${RLJOB_CLUSTER_NAME:-rljob}"
KUBECONFIG_PATH="$STATE/kubeconfig"
export KWOK_WORKDIR="$STATE/kwok"
if ! command -v go >/dev/null && [ -x /usr/local/go/bin/go ]; then export PATH="/usr/local/go/bin:$PATH"; fi
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
# Never put the working directory on sys.path: the repo's ./operator would shadow the stdlib module.
export PYTHONSAFEPATH=1
JS_DIR="$STATE/jobset"
KQ_DIR="$STATE/kueue"
# Kueue reads its metrics-server certificate from this fixed path whenever its internal certificate
# management is off (cmd/kueue/main.go); its internal management cannot serve 127.0.0.1 (see start_kueue).
KUEUE_METRICS_CERTS="${RLJOB_KUEUE_METRICS_CERTS:-/etc/kueue/metrics/certs}"
LOGS="$STATE/logs"

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

kubectl() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_PATH" "$@"; }
kwokctl() { "$BIN/kwokctl" "$@"; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

apiserver_ready() {
  [ -f "$KUBECONFIG_PATH" ] && kubectl get --raw /readyz >/dev/null 2>&1
}

cmd_status() {
  apiserver_ready || { log "API server not answering"; return 1; }
  pid_alive "$JS_DIR/pid" || { log "JobSet controller not running"; return 1; }
  return 0
}

cmd_kueue_status() {
  cmd_status || return 1
  pid_alive "$KQ_DIR/pid" || { log "Kueue not running"; return 1; }
  return 0
}

stop_pidfile() {
  [ -f "$1" ] || return 0
  local pid; pid="$(cat "$1")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

# Stop Kueue and the JobSet controller (by their pid files), then every kwokctl component.
stop_all() {
  stop_pidfile "$KQ_DIR/pid"
  stop_pidfile "$JS_DIR/pid"
  if [ -d "$KWOK_WORKDIR/clusters/$NAME" ]; then
    kwokctl delete cluster --name "$NAME" >/dev/null 2>&1 || true
    # kwokctl stops components through their pid files; make sure none survived.
    local f
    for f in "$KWOK_WORKDIR/clusters/$NAME"/pids/*.pid; do
      [ -f "$f" ] || continue
      kill -9 "$(cat "$f")" 2>/dev/null || true
    done
    rm -rf "$KWOK_WORKDIR/clusters/$NAME"
  fi
  rm -f "$KUBECONFIG_PATH" "$STATE/owner-pytest"
}

cmd_down() {
  mkdir -p "$STATE"
  exec 9>"$STATE/lock"; flock 9
  stop_all
  log "cluster $NAME stopped"
}

write_kwokctl_config() {
  cat > "$STATE/kwokctl.yaml" <<EOF
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokctlConfiguration
options:
  runtime: binary
  bindAddress: 127.0.0.1
  quietPull: true
  kubeAuthorization: true
  kubeAdmission: true
  kubeApiserverBinary: $BIN/kube-apiserver
  kubeControllerManagerBinary: $BIN/kube-controller-manager
  kubeSchedulerBinary: $BIN/kube-scheduler
  kubectlBinary: $BIN/kubectl
  etcdBinary: $BIN/etcd
  kwokControllerBinary: $BIN/kwok
  cacheDir: $STATE/kwok-cache
---
EOF
  cat "$HACK/cluster/stages.yaml" >> "$STATE/kwokctl.yaml"
}

# Certificates for the JobSet webhook server: a CA (its bundle goes into the webhook configurations) and a
# serving certificate for 127.0.0.1, where the API server reaches the webhook.
make_certs() {
  local d="$JS_DIR/certs"
  [ -f "$d/tls.crt" ] && [ -f "$d/ca.crt" ] && return 0
  mkdir -p "$d"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=rljob-local-webhook-ca" \
    -keyout "$d/ca.key" -out "$d/ca.crt" >/dev/null 2>&1
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout "$d/tls.key" -out "$d/tls.csr" \
    >/dev/null 2>&1
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' > "$d/ext.cnf"
  openssl x509 -req -in "$d/tls.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 3650 \
    -extfile "$d/ext.cnf" -out "$d/tls.crt" >/dev/null 2>&1
}

jobset_module_dir() {
  (cd "$HACK/jobset" && go mod download "sigs.k8s.io/jobset@$JOBSET_VERSION" >/dev/null 2>&1 || true
   go list -m -f '{{.Dir}}' sigs.k8s.io/jobset)
}

start_jobset() {
  mkdir -p "$JS_DIR" "$LOGS"
  make_certs
  local port health moddir restart_job_gate
  case "${RLJOB_JOBSET_RESTART_JOB_GATE:-on}" in
    on) restart_job_gate=true ;;
    off) restart_job_gate=false ;;
    *) die "RLJOB_JOBSET_RESTART_JOB_GATE: on or off, not ${RLJOB_JOBSET_RESTART_JOB_GATE}" ;;
  esac
  port="$(free_port)"; health="$(free_port)"
  moddir="$(jobset_module_dir)"
  [ -d "$moddir/config/components" ] || die "JobSet module not found in the Go module cache ($moddir)"
  # The CRD as the module ships it (server-side apply: it is too large for the last-applied annotation).
  kubectl apply --server-side --force-conflicts \
    -f "$moddir/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml" >/dev/null
  local i est=""
  for i in $(seq 120); do
    est="$(kubectl get crd jobsets.jobset.x-k8s.io \
      -o jsonpath='{.status.conditions[?(@.type=="Established")].status}' 2>/dev/null || true)"
    [ "$est" = True ] && break
    sleep 0.5
  done
  [ "$est" = True ] || die "the JobSet CRD is not established"
  cat > "$JS_DIR/config.yaml" <<EOF
apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: $port
  certDir: $JS_DIR/certs
metrics:
  bindAddress: "0"
health:
  healthProbeBindAddress: 127.0.0.1:$health
# rljob restarts a failed sampler Job alone (recipes/failure.py): alpha in JobSet v0.12.0, off by
# default there; RLJOB_JOBSET_RESTART_JOB_GATE=off keeps JobSet's default (the operator then falls back).
featureGates:
  RestartJob: $restart_job_gate
EOF
  # setsid: its own session, so it outlives this script and is stopped only through its pid file.
  setsid "$BIN/jobset-manager" --config "$JS_DIR/config.yaml" --kubeconfig "$KUBECONFIG_PATH" \
    --zap-devel=false >"$LOGS/jobset.log" 2>&1 </dev/null 9>&- &
  echo $! > "$JS_DIR/pid"
  # The webhook configurations as the module ships them (with its kustomize patches: the pod webhooks
  # only see JobSet pods), pointed at the local server by URL, with our CA.
  kubectl create --dry-run=client -o json -f "$moddir/config/components/webhook/manifests.yaml" \
    | python3 "$HACK/cluster/jobset_webhooks.py" "https://127.0.0.1:$port" "$JS_DIR/certs/ca.crt" \
    > "$JS_DIR/webhooks.json"
  kubectl apply -f "$JS_DIR/webhooks.json" >/dev/null
  for i in $(seq 120); do
    pid_alive "$JS_DIR/pid" || { tail -20 "$LOGS/jobset.log" >&2; die "JobSet controller exited"; }
    if curl -sf "http://127.0.0.1:$health/readyz" >/dev/null 2>&1; then break; fi
    sleep 0.5
  done
  # Ready means the webhooks answer: a server-side dry run goes through both JobSet webhooks, and the
  # mutating one sets the pod restartPolicy (which the probe leaves out and the CRD cannot default).
  local got
  for i in $(seq 60); do
    got="$(kubectl create --dry-run=server -f "$HACK/cluster/probe-jobset.yaml" \
      -o jsonpath='{.spec.replicatedJobs[0].template.spec.template.spec.restartPolicy}' 2>"$LOGS/probe.err")" || true
    [ "$got" = OnFailure ] && return 0
    sleep 0.5
  done
  cat "$LOGS/probe.err" >&2
  die "JobSet webhooks do not answer (log: $LOGS/jobset.log)"
}

module_dir() {  # module_dir COMPONENT MODULE VERSION: the module's source in the Go module cache
  (cd "$HACK/$1" && go mod download "$2@$3" >/dev/null 2>&1 || true
   go list -m -f '{{.Dir}}' "$2")
}

# Kueue as a local process, like the JobSet controller: the CRDs and webhook configurations of its module
# (hack/cluster/kueue_manifests.py: conversion and admission webhooks by URL, with the CA of make_certs;
# only the JobSet integration), a config with leader election, internal cert management and the
# visibility server off. Kueue's internal cert management would issue a certificate for
# <service>.<namespace>.svc only, which the API server cannot reach here; so it serves the 127.0.0.1
# certificate of make_certs, and its (unused) metrics server reads the same one from KUEUE_METRICS_CERTS.
start_kueue() {
  mkdir -p "$KQ_DIR" "$LOGS"
  make_certs
  local certs="$JS_DIR/certs"
  if ! [ -r "$KUEUE_METRICS_CERTS/tls.crt" ] || ! [ -r "$KUEUE_METRICS_CERTS/tls.key" ]; then
    mkdir -p "$KUEUE_METRICS_CERTS" 2>/dev/null && cp "$certs/tls.crt" "$certs/tls.key" "$KUEUE_METRICS_CERTS/" \
      || die "Kueue needs a certificate in $KUEUE_METRICS_CERTS (tls.crt, tls.key) and it cannot be written here"
  fi
  local port health moddir i
  port="$(free_port)"; health="$(free_port)"
  moddir="$(module_dir kueue sigs.k8s.io/kueue "$KUEUE_VERSION")"
  [ -f "$moddir/config/components/crd/kustomization.yaml" ] || die "Kueue module not found in the Go module cache ($moddir)"
  KUBECTL="$BIN/kubectl" python3 "$HACK/cluster/kueue_manifests.py" crds "$moddir" "https://127.0.0.1:$port" \
    "$certs/ca.crt" > "$KQ_DIR/crds.json"
  kubectl apply --server-side --force-conflicts -f "$KQ_DIR/crds.json" >/dev/null
  kubectl wait --for condition=Established --timeout 60s -f "$KQ_DIR/crds.json" >/dev/null
  kubectl get namespace kueue-system >/dev/null 2>&1 || kubectl create namespace kueue-system >/dev/null
  cat > "$KQ_DIR/config.yaml" <<CONFIG
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: $port
  certDir: $certs
metrics:
  bindAddress: "0"
health:
  healthProbeBindAddress: 127.0.0.1:$health
manageJobsWithoutQueueName: false
integrations:
  frameworks:
  - jobset.x-k8s.io/jobset
featureGates:
  VisibilityOnDemand: false
CONFIG
  # Where Kueue's release manifests keep its configuration (rljob doctor reads WaitForPodsReady there).
  kubectl -n kueue-system create configmap kueue-manager-config \
    --from-file=controller_manager_config.yaml="$KQ_DIR/config.yaml" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
  KUBECONFIG="$KUBECONFIG_PATH" setsid "$BIN/kueue" --config "$KQ_DIR/config.yaml" --zap-devel=false \
    >"$LOGS/kueue.log" 2>&1 </dev/null 9>&- &
  echo $! > "$KQ_DIR/pid"
  KUBECTL="$BIN/kubectl" python3 "$HACK/cluster/kueue_manifests.py" webhooks "$moddir" "https://127.0.0.1:$port" \
    "$certs/ca.crt" > "$KQ_DIR/webhooks.json"
  kubectl apply -f "$KQ_DIR/webhooks.json" >/dev/null
  for i in $(seq 240); do
    pid_alive "$KQ_DIR/pid" || { tail -20 "$LOGS/kueue.log" >&2; die "Kueue exited"; }
    if curl -sf "http://127.0.0.1:$health/readyz" >/dev/null 2>&1; then break; fi
    sleep 0.5
  done
  # Ready means its JobSet webhook answers: Kueue suspends a new JobSet that names a queue.
  local got
  for i in $(seq 120); do
    got="$(kubectl label --local -f "$HACK/cluster/probe-jobset.yaml" -o json kueue.x-k8s.io/queue-name=probe \
      | kubectl create --dry-run=server -f - -o jsonpath='{.spec.suspend}' 2>"$LOGS/kueue-probe.err")" || true
    [ "$got" = true ] && { log "Kueue $KUEUE_VERSION running (log: $LOGS/kueue.log)"; return 0; }
    pid_alive "$KQ_DIR/pid" || break
    sleep 0.5
  done
  cat "$LOGS/kueue-probe.err" >&2
  tail -20 "$LOGS/kueue.log" >&2
  die "Kueue webhooks do not answer (log: $LOGS/kueue.log)"
}

cmd_kueue_up() {
  mkdir -p "$STATE" "$LOGS"
  exec 9>"$STATE/lock"; flock 9
  "$HACK/build.sh" kueue 9>&-
  cmd_status || die "the cluster is not running (hack/cluster.sh up)"
  if pid_alive "$KQ_DIR/pid"; then log "Kueue already running"; return 0; fi
  local start; start=$(date +%s)
  start_kueue
  log "Kueue up in $(( $(date +%s) - start ))s"
}

# (kubectl wait fails at once on a node whose status has no conditions yet, so poll.)
wait_nodes_ready() {
  local want got i
  want="$(python3 "$HACK/cluster/nodes.py" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["items"]))')"
  for i in $(seq 120); do
    got="$(kubectl get nodes -o jsonpath='{range .items[*]}{range .status.conditions[?(@.type=="Ready")]}{.status}{"\n"}{end}{end}' | grep -c True || true)"
    [ "$got" -ge "$want" ] && return 0
    sleep 0.5
  done
  die "only $got of $want nodes Ready"
}

cmd_up() {
  mkdir -p "$STATE" "$LOGS"
  # One `up` at a time (several test sessions may start at once); the build happens under the lock.
  exec 9>"$STATE/lock"; flock 9
  "$HACK/build.sh" 9>&-
  if [ -n "${RLJOB_KUEUE:-}" ]; then "$HACK/build.sh" kueue 9>&-; fi
  if cmd_status 2>/dev/null; then
    if [ -n "${RLJOB_KUEUE:-}" ] && ! pid_alive "$KQ_DIR/pid"; then start_kueue; fi
    # Someone other than a pytest session asked for it: it is theirs now, pytest leaves it running.
    [ "${RLJOB_CLUSTER_OWNER:-}" = pytest ] || rm -f "$STATE/owner-pytest"
    log "cluster $NAME already running"
    echo "export KUBECONFIG=$KUBECONFIG_PATH"
    return 0
  fi
  local start; start=$(date +%s)
  stop_all  # whatever is left from an earlier run
  write_kwokctl_config
  log "creating cluster $NAME (kwokctl binary runtime, state in $STATE)"
  if ! kwokctl create cluster --name "$NAME" --config "$STATE/kwokctl.yaml" \
      --kubeconfig "$KUBECONFIG_PATH" --wait 120s >"$LOGS/kwokctl.log" 2>&1 9>&-; then
    tail -30 "$LOGS/kwokctl.log" >&2
    stop_all
    die "kwokctl create cluster failed (log: $LOGS/kwokctl.log)"
  fi
  # From here on a failure stops what was started (set -e does not act inside `if f; then`).
  UP_OK=0
  trap 'if [ "$UP_OK" != 1 ]; then log "up failed: stopping the cluster"; stop_all; fi' EXIT
  kubectl config use-context "kwok-$NAME" >/dev/null
  python3 "$HACK/cluster/nodes.py" | kubectl apply -f - >/dev/null
  start_jobset
  if [ -n "${RLJOB_KUEUE:-}" ]; then start_kueue; fi
  wait_nodes_ready
  UP_OK=1
  # Who started it: a pytest session stops it when its last user leaves (tests/fixtures/cluster.py).
  if [ "${RLJOB_CLUSTER_OWNER:-}" = pytest ]; then touch "$STATE/owner-pytest"; else rm -f "$STATE/owner-pytest"; fi
  log "cluster $NAME up in $(( $(date +%s) - start ))s: $(kubectl get nodes --no-headers | wc -l) nodes"
  echo "export KUBECONFIG=$KUBECONFIG_PATH"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  kueue-up) cmd_kueue_up ;;
  kueue-status) cmd_kueue_status ;;
  kubeconfig) echo "$KUBECONFIG_PATH" ;;
  *) echo "usage: $0 up|down|status|kueue-up|kueue-status|kubeconfig" >&2; exit 2 ;;
esac
