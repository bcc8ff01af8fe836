#!/usr/bin/env bash
# Installs what the build, the demo and the tests need on Debian or Ubuntu, when it is missing.
set -euo pipefail

need=()
have() { command -v "$1" >/dev/null 2>&1; }
have clang      || need+=(clang)
have llvm-strip || need+=(llvm)
have bpftool    || need+=(bpftool)
have iptables   || need+=(iptables)
have nft        || need+=(nftables)
have ip         || need+=(iproute2)
have capsh      || need+=(libcap2-bin)
have ping       || need+=(iputils-ping)
have iperf3     || need+=(iperf3)
have make       || need+=(make)
# The image (make image) and its container tests (test/container): a Debian rootfs from the
# archive, podman with runc (crun refuses some hybrid cgroup layouts), and containers-common's
# seccomp profile, which deploy/seccomp/ip-masq-agent.json derives from.
have mmdebstrap || need+=(mmdebstrap)
have podman     || need+=(podman)
have runc       || need+=(runc)
[ -f /usr/share/containers/seccomp.json ] || need+=(golang-github-containers-common)
# The cluster tests (internal/cluster, test/cluster): etcd for the API server's storage,
# containerd (with runc, above) for the node's pods, the CNI plugins (bridge, host-local) for
# their network, nsenter and unshare (util-linux) to run the node in its own namespaces.
have etcd       || need+=(etcd-server)
have containerd || need+=(containerd)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
have nsenter    || need+=(util-linux)
# The kernel matrix (internal/vm, test/kernels): QEMU, a static busybox for the guests'
# initramfs, kmod's depmod and modprobe (the guests load their kernel's modules with the host's
# modprobe), cpio and xz for the initramfs, and the Debian archive's keys, which verify the
# kernel packages (on Ubuntu too).
have qemu-system-x86_64 || need+=(qemu-system-x86)
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'ok installed' || need+=(busybox-static)
have depmod     || need+=(kmod)
have cpio       || need+=(cpio)
have xz         || need+=(xz-utils)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
# `deps.sh bench`: what make bench needs beyond the tests.
if [ "${1:-}" = bench ]; then
	have gnuplot || need+=(gnuplot-nox)
fi

[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
	echo "missing: ${need[*]}; run as root (or: apt-get install ${need[*]})" >&2
	exit 1
fi
if ! have apt-get; then
	echo "missing: ${need[*]}; this script installs them only with apt-get (Debian, Ubuntu)" >&2
	exit 1
fi
echo "installing: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
# Install services (containerd) without starting them: the tests run their own, in namespaces
# of their own, never one on the host. policy-rc.d is the Debian way to say so.
if [ ! -e /usr/sbin/policy-rc.d ]; then
	printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
	chmod 0755 /usr/sbin/policy-rc.d
	trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
