#!/usr/bin/env bash
# Installs the Debian packages kvmesh needs to build and test, when any is missing.
# Idempotent: a machine that has them all returns at once without touching apt.
set -euo pipefail

packages=(
  build-essential cmake pkg-config git libxxhash-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev
  libssl-dev openssl
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev lld
  iproute2 procps iperf3
  libyaml-cpp-dev dnsmasq-base nlohmann-json3-dev
  prometheus-cpp-dev libspdlog-dev libcurl4-openssl-dev
  python3 python3-grpcio python3-protobuf python3-numpy
  python3-torch
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

echo "bootstrap: installing ${missing[*]}" >&2
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "bootstrap: done" >&2
