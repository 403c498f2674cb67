#!/usr/bin/env bash
# Builds the image helm/shoal runs and tags it with the chart's appVersion (shoal's version),
# from the repository's root; with --push, pushes it too.
#
#   deploy/docker/build.sh REGISTRY/shoal          # docker build ... -t REGISTRY/shoal:0.1.0
#   deploy/docker/build.sh REGISTRY/shoal --push   # and docker push REGISTRY/shoal:0.1.0
#
# The chart's default image.tag is its appVersion, so a release installed from this checkout
# runs the image built from it. DOCKER names another client (podman, say).
set -euo pipefail
cd "$(dirname "$0")/../.."
image=${1:?usage: deploy/docker/build.sh IMAGE [--push]}
push=${2:-}
[ -z "$push" ] || [ "$push" = "--push" ] || { echo "unknown argument: $push" >&2; exit 2; }
app_version=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' helm/shoal/Chart.yaml)
shoal_version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' shoal/__init__.py)
if [ -z "$app_version" ] || [ "$app_version" != "$shoal_version" ]; then
  echo "helm/shoal/Chart.yaml's appVersion ($app_version) is not shoal's version" \
    "($shoal_version, shoal/__init__.py): make them equal first" >&2
  exit 1
fi
docker=${DOCKER:-docker}
echo "building $image:$app_version"
"$docker" build -f deploy/docker/Dockerfile -t "$image:$app_version" .
if [ "$push" = "--push" ]; then
  echo "pushing $image:$app_version"
  "$docker" push "$image:$app_version"
fi
