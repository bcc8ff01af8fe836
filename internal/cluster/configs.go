package cluster

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
)

// The components' configuration files, each written from the node's facts.

// cniBinDir holds the CNI plugins (Debian's containernetworking-plugins).
const cniBinDir = "/usr/lib/cni"

// containerdConfig is containerd's: its store and state in the node's mount namespace's
// default places, cgroupfs (no systemd), restrict_oom_score_adj (this machine's sandbox lacks
// CAP_SYS_RESOURCE, so a pod may not get a lower score than containerd's own), the pause image
// built here, and the CNI configuration in the node's directory.
func containerdConfig(cniConfDir, pauseRef string) string {
	return fmt.Sprintf(`version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "/var/lib/containerd-opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
`, pauseRef, cniBinDir, cniConfDir)
}

// cniConfig is the pod network: one bridge with the node's pod range from host-local, the
// bridge the pods' gateway, and no masquerading of the bridge plugin's own (the agent's job);
// with portmap, the portmap plugin after it for the pods' hostPorts (containerd passes their
// portMappings).
func cniConfig(podCIDRs []netip.Prefix, portmap bool) string {
	var ranges, routes []string
	for _, p := range podCIDRs {
		ranges = append(ranges, fmt.Sprintf(`[{"subnet": %q, "gateway": %q}]`, p.Masked(), p.Masked().Addr().Next()))
		def := "0.0.0.0/0"
		if p.Addr().Is6() {
			def = "::/0"
		}
		routes = append(routes, fmt.Sprintf(`{"dst": %q}`, def))
	}
	var more string
	if portmap {
		more = `,
    {
      "type": "portmap",
      "capabilities": {"portMappings": true}
    }`
	}
	return fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "pods",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [%s],
        "routes": [%s]
      }
    }%s
  ]
}
`, strings.Join(ranges, ", "), strings.Join(routes, ", "), more)
}

// portmap reports whether the portmap plugin is installed (Debian's containernetworking-plugins
// ship it); without it pods' hostPorts go nowhere.
func portmap() bool {
	_, err := os.Stat(filepath.Join(cniBinDir, "portmap"))
	return err == nil
}

// kubeletConfig is the kubelet's: cgroupfs with a cgroup root of the node's own (so teardown
// knows every cgroup the pods got), cgroup v1 allowed (this machine's hierarchy is hybrid), no
// swap check, an OOM score it may keep, eviction thresholds no test disk reaches, certificate
// and webhook authentication so the API server's logs and exec work, and the cluster's DNS
// (DNSAddress, served when ClusterOptions.DNS deploys CoreDNS) in the pods' resolv.conf.
func kubeletConfig(caFile, cgroupRoot, resolvConf string) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: %q
authorization:
  mode: Webhook
cgroupDriver: cgroupfs
cgroupRoot: %q
cgroupsPerQOS: true
failCgroupV1: false
failSwapOn: false
oomScoreAdj: 0
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
clusterDomain: %s
clusterDNS: [%q]
resolvConf: %q
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
serializeImagePulls: false
imageGCHighThresholdPercent: 100
evictionHard:
  memory.available: 1Mi
  nodefs.available: "1%%"
  nodefs.inodesFree: "1%%"
  imagefs.available: "1%%"
evictionPressureTransitionPeriod: 5s
`, caFile, cgroupRoot, ClusterDomain, DNSAddress, resolvConf)
}

// kubeProxyConfig is kube-proxy's in mode (iptables or nftables). Conntrack is left as the
// kernel has it (zeros): its global settings are the host's, not the node's.
func kubeProxyConfig(mode, kubeconfig, node string, podCIDRs []netip.Prefix) string {
	cidrs := make([]string, len(podCIDRs))
	for i, p := range podCIDRs {
		cidrs[i] = p.Masked().String()
	}
	return fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: %s
hostnameOverride: %s
clusterCIDR: %s
clientConnection:
  kubeconfig: %q
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
`, mode, node, strings.Join(cidrs, ","), kubeconfig)
}
