#!/usr/bin/env bash
# Builds dpukv's OCI image offline — no daemon, no registry — with Debian's umoci from the release
# binaries, then checks it: unpacks the image into a fresh root and runs each binary's --version
# there (chroot), as the image's non-root user. The image holds the binaries, the shared libraries
# `ldd` lists for them, /etc/passwd and /etc/group with the user dpukv (10001), and /tmp.
# Output: an OCI layout in $OUT (default target/oci), tag $TAG (default the workspace version).
# Without umoci (not installable), says so and exits 0 (the check is skipped, not passed).
# PROFILE=debug packs the debug binaries instead (CI: the ones its tests already built).
set -euo pipefail
cd "$(dirname "$0")/.."
BINS=(dpukv dpukv-bench dpukv-node dpukv-dpu dpukv-gateway dpukv-device-plugin dpukv-operator)
if ! command -v umoci >/dev/null; then
  bash scripts/setup.sh umoci=umoci || true
fi
if ! command -v umoci >/dev/null; then
  echo "SKIPPED: umoci is not installed and could not be installed (apt-get install umoci); no image built" >&2
  exit 0
fi
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
TAG=${TAG:-$VERSION}
OUT=${OUT:-target/oci}
args=(); for b in "${BINS[@]}"; do args+=(--bin "$b"); done
PROFILE=${PROFILE:-release}
if [ "$PROFILE" = release ]; then cargo build --release --locked "${args[@]}"; else cargo build --locked "${args[@]}"; fi
BIN=target/$PROFILE
WORK=$(mktemp -d /tmp/dpukv-image.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
rm -rf "$OUT"; mkdir -p "$(dirname "$OUT")"
umoci init --layout "$OUT"
umoci new --image "$OUT:$TAG"
umoci unpack --image "$OUT:$TAG" "$WORK/bundle" >/dev/null
ROOT="$WORK/bundle/rootfs"
mkdir -p "$ROOT/usr/local/bin" "$ROOT/etc" "$ROOT/tmp" "$ROOT/var/lib/dpukv"
chmod 1777 "$ROOT/tmp"
for b in "${BINS[@]}"; do
  install -m 0755 "$BIN/$b" "$ROOT/usr/local/bin/$b"
  # Debug information stays out of the image (the release profile keeps line tables).
  if command -v strip >/dev/null; then strip --strip-debug "$ROOT/usr/local/bin/$b"; fi
  # Shared libraries, at the paths the dynamic loader looks for them.
  ldd "$BIN/$b" | awk '/=>/ {print $3} /^[ \t]*\// {print $1}' | while read -r lib; do
    [ -f "$lib" ] || continue
    mkdir -p "$ROOT$(dirname "$lib")"
    cp -L "$lib" "$ROOT$lib"
  done
done
printf 'root:x:0:0:root:/root:/sbin/nologin\ndpukv:x:10001:10001:dpukv:/var/lib/dpukv:/sbin/nologin\n' >"$ROOT/etc/passwd"
printf 'root:x:0:\ndpukv:x:10001:\n' >"$ROOT/etc/group"
chown -R 10001:10001 "$ROOT/var/lib/dpukv"
umoci repack --image "$OUT:$TAG" "$WORK/bundle" >/dev/null
umoci config --image "$OUT:$TAG" --config.user 10001:10001 --config.workingdir /var/lib/dpukv \
  --config.entrypoint /usr/local/bin/dpukv --config.env PATH=/usr/local/bin:/usr/bin:/bin \
  --config.label org.opencontainers.image.title=dpukv --config.label "org.opencontainers.image.version=$VERSION"
umoci gc --layout "$OUT"

# The check: a fresh unpack of the tagged image, each binary's --version run inside it.
umoci unpack --image "$OUT:$TAG" "$WORK/check" >/dev/null
CHECK="$WORK/check/rootfs"
user=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['process']['user']['uid'])" "$WORK/check/config.json")
[ "$user" = 10001 ] || { echo "the image's user is $user, not 10001" >&2; exit 1; }
for b in "${BINS[@]}"; do
  got=$(chroot --userspec=10001:10001 "$CHECK" "/usr/local/bin/$b" --version)
  case "$got" in
    *"$VERSION"*) echo "ok: $got" ;;
    *) echo "$b --version in the image printed: $got" >&2; exit 1 ;;
  esac
done
size=$(du -sh "$OUT" | cut -f1)
echo "image $OUT:$TAG built and checked ($size; ${#BINS[@]} binaries run as uid 10001 in the unpacked root)"
