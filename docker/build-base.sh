#!/usr/bin/env bash
# A base image for building Baton's images without a container registry or daemon (the
# development VM): Debian bookworm made by debootstrap, with python3 and its venv module,
# trusting the CA bundle this machine trusts (a proxy's, say), committed with buildah as
# localhost/baton-base:bookworm. `make test-images` runs it once; it does nothing when the
# image exists.
#   docker/build-base.sh [IMAGE]
set -euo pipefail
IMAGE=${1:-localhost/baton-base:bookworm}
buildah() { command buildah --storage-driver vfs "$@"; }  # no overlay here: vfs
if buildah images --format '{{.Name}}:{{.Tag}}' | grep -qx "$IMAGE"; then
  echo "$IMAGE exists"; exit 0
fi
ROOTFS=$(mktemp -d)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm \
  "$ROOTFS" http://deb.debian.org/debian >/dev/null
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
ctr=$(buildah from scratch)
mnt=$(buildah mount "$ctr")
cp -a "$ROOTFS/." "$mnt/"
buildah umount "$ctr" >/dev/null
buildah commit --rm "$ctr" "$IMAGE" >/dev/null
echo "built $IMAGE"
