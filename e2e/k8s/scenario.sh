#!/usr/bin/env bash
# The operator's scenario on a real Kubernetes cluster (kind, or any cluster KUBECONFIG points
# at): install the chart, create a three-node DpuKvCluster (device emulator, managed etcd), write
# keys through the gateway, scale to 4 and then to 2 (drains before pods go), upgrade (a new
# image tag: primaries step down pod by pod), check every acknowledged key after each step,
# delete the cluster and check its children went with it.
#
# NOT run in CI: this repository's CI machine has no Kubernetes (the reconciler is tested there
# against a mock API server, docs/kubernetes.md). Needs: kubectl, helm, curl, and either
#   KIND=1  — creates a kind cluster `dpukv` (needs kind and docker) and loads the image into it,
#   or an existing cluster whose nodes can pull $IMAGE:$TAG.
# Environment: IMAGE (default dpukv/dpukv), TAG (default the chart's appVersion), KEYS (default
# 1000), NS (default dpukv-e2e), KEEP=1 to leave everything in place at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."

IMAGE=${IMAGE:-dpukv/dpukv}
TAG=${TAG:-$(awk '/^appVersion:/ {gsub(/"/, "", $2); print $2}' charts/dpukv/Chart.yaml)}
KEYS=${KEYS:-1000}
NS=${NS:-dpukv-e2e}
NAME=demo
HTTP=18080

say() { printf '\n== %s\n' "$*"; }
fail() { echo "FAILED: $*" >&2; exit 1; }

# Waits until `kubectl get dpukv NAME` reports phase $1 (and, with $2, that many ready nodes) for
# the resource's current generation: right after a patch the status still describes the spec
# before it (its observedGeneration is behind) and says nothing yet.
wait_phase() {
  local want=$1 nodes=${2:-} deadline=$((SECONDS + ${3:-900}))
  while ((SECONDS < deadline)); do
    local phase ready generation observed
    phase=$(kubectl -n "$NS" get dpukv "$NAME" -o jsonpath='{.status.phase}' 2>/dev/null || true)
    ready=$(kubectl -n "$NS" get dpukv "$NAME" -o jsonpath='{.status.readyNodes}' 2>/dev/null || true)
    generation=$(kubectl -n "$NS" get dpukv "$NAME" -o jsonpath='{.metadata.generation}' 2>/dev/null || true)
    observed=$(kubectl -n "$NS" get dpukv "$NAME" -o jsonpath='{.status.observedGeneration}' 2>/dev/null || true)
    if [[ -n $generation && $observed == "$generation" && $phase == "$want" && ( -z $nodes || $ready == "$nodes" ) ]]; then
      echo "phase $phase, $ready nodes ready"
      return 0
    fi
    sleep 5
  done
  kubectl -n "$NS" get dpukv "$NAME" -o yaml || true
  fail "phase $want${nodes:+ with $nodes nodes} not reached"
}

forward() {
  pkill -f "port-forward.*svc/$NAME $HTTP" 2>/dev/null || true
  kubectl -n "$NS" port-forward "svc/$NAME" "$HTTP:8080" >/dev/null 2>&1 &
  for _ in $(seq 50); do curl -sf "localhost:$HTTP/readyz" >/dev/null && return 0; sleep 0.2; done
  fail "the gateway does not answer through the port-forward"
}

write_keys() {  # $1: the value's suffix
  for i in $(seq "$KEYS"); do
    curl -sf -X PUT "localhost:$HTTP/v1/kv/k$i" -d "{\"value\": \"v$i-$1\"}" >/dev/null || fail "put k$i"
  done
}

check_keys() {  # $1: the value's suffix every key must have
  forward
  local bad=0
  for i in $(seq "$KEYS"); do
    got=$(curl -sf "localhost:$HTTP/v1/kv/k$i" | sed -n 's/.*"value":"\([^"]*\)".*/\1/p')
    [[ $got == "v$i-$1" ]] || { bad=$((bad + 1)); echo "k$i: '$got'"; }
  done
  ((bad == 0)) || fail "$bad of $KEYS keys lost or wrong"
  echo "all $KEYS keys read back"
}

if [[ ${KIND:-} == 1 ]]; then
  say "kind cluster and image"
  kind get clusters | grep -qx dpukv || kind create cluster --name dpukv
  docker build -f packaging/Dockerfile -t "$IMAGE:$TAG" .
  docker tag "$IMAGE:$TAG" "$IMAGE:$TAG-next"
  kind load docker-image --name dpukv "$IMAGE:$TAG" "$IMAGE:$TAG-next"
fi

say "install the chart"
helm upgrade --install dpukv charts/dpukv -n "$NS" --create-namespace \
  --set image.repository="$IMAGE" --set image.tag="$TAG" --wait --timeout 5m

say "a three-node cluster"
kubectl -n "$NS" apply -f - <<YAML
apiVersion: dpukv.io/v1alpha1
kind: DpuKvCluster
metadata:
  name: $NAME
spec:
  nodes: 3
  replicationFactor: 2
  image: $IMAGE
  version: "$TAG"
  storage: {size: 1Gi}
  etcd: {managed: {replicas: 1, storage: 1Gi}}
  device: {mode: Emulator}
  gateway: {replicas: 1}
YAML
wait_phase Running 3
forward
write_keys a
check_keys a

say "scale out to 4"
kubectl -n "$NS" scale dpukv "$NAME" --replicas=4
wait_phase Running 4
check_keys a

say "scale in to 2 (nodes 3 and 4 drain first)"
kubectl -n "$NS" scale dpukv "$NAME" --replicas=2
wait_phase Running 2
[[ $(kubectl -n "$NS" get statefulset "$NAME-node" -o jsonpath='{.spec.replicas}') == 2 ]] || fail "the StatefulSet did not shrink"
check_keys a

say "upgrade (a new tag: pods restart one at a time, primaries moved first)"
write_keys b
kubectl -n "$NS" patch dpukv "$NAME" --type merge -p "{\"spec\": {\"version\": \"$TAG-next\"}}"
wait_phase Running 2
[[ $(kubectl -n "$NS" get dpukv "$NAME" -o jsonpath='{.status.version}') == "$TAG-next" ]] || fail "status.version"
check_keys b

say "delete the cluster"
pkill -f "port-forward.*svc/$NAME $HTTP" 2>/dev/null || true
if [[ ${KEEP:-} != 1 ]]; then
  kubectl -n "$NS" delete dpukv "$NAME" --wait
  for kind in statefulset deployment service poddisruptionbudget; do
    left=$(kubectl -n "$NS" get "$kind" -l app.kubernetes.io/instance="$NAME" -o name)
    [[ -z $left ]] || fail "left behind: $left"
  done
  helm uninstall dpukv -n "$NS"
fi
say "scenario passed"
