// Package cluster runs the product as users do: a real single-node Kubernetes cluster
// (internal/cluster) with the agent's image installed by the Helm chart and the kustomize base,
// for each kube-proxy mode and each backend the node can run, with real pods on the bridge CNI
// network talking to an outside namespace beyond the node's uplink.
package cluster

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/image"
	"helm.sh/helm/v3/pkg/chart"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The outside namespace's addresses the pods talk to: one the test configuration keeps the
// pod's address for, one it masquerades.
var (
	outsideKept   = cluster.OutsideAddress // 172.30.0.1, in 172.16.0.0/12
	outsideMasq   = netip.MustParseAddr("203.0.113.1")
	outsideClient = netip.MustParseAddr("198.51.100.7") // an outside client the policy would masquerade
)

// agentConfig is the configuration the chart installs: 172.16.0.0/12 kept, the rest
// masqueraded.
const agentConfig = `nonMasqueradeCIDRs:
  - 10.0.0.0/8
  - 172.16.0.0/12
masqOutBound: true
resyncInterval: 60s
`

// backend is one datapath the chart can select, and how to see it installed on the node.
type backend struct {
	name string
	// flag is the chart's backend value; args are extra agent flags.
	flag string
	args []string
	// kind is what installed() must find: "bpf", "nftables" or "iptables".
	kind string
}

// backends are the node's datapaths: BPF with each attach mode, nftables, iptables (in the
// iptables mode kube-proxy and the kubelet use on this node: the agent follows it).
var backends = []backend{
	{name: "bpf-tcx", flag: "bpf", args: []string{"--attach-mode=tcx"}, kind: "bpf"},
	{name: "bpf-tc", flag: "bpf", args: []string{"--attach-mode=tc"}, kind: "bpf"},
	{name: "nftables", flag: "nftables", kind: "nftables"},
	{name: "iptables", flag: "iptables", kind: "iptables"},
}

// nodes are the kinds of node the suite runs: kube-proxy in iptables mode with either
// iptables (so the agent's iptables backend runs in both modes, following kube-proxy's rules),
// and in nftables mode.
var nodes = []struct {
	name string
	opts cluster.ClusterOptions
}{
	{"iptables-nft", cluster.ClusterOptions{ProxyMode: "iptables", IptablesMode: "nft"}},
	{"iptables-legacy", cluster.ClusterOptions{ProxyMode: "iptables", IptablesMode: "legacy"}},
	{"nftables", cluster.ClusterOptions{ProxyMode: "nftables"}},
}

// TestCluster brings a cluster up per kube-proxy mode and runs the agent in it, installed by
// the kustomize base, then by the chart on each backend.
func TestCluster(t *testing.T) {
	cluster.Require(t)
	start := time.Now()
	img := buildAgentImage(t)
	t.Logf("agent image built in %v", time.Since(start).Round(time.Second))
	start = time.Now()
	prev := buildPreviousImage(context.Background(), t, img)
	t.Logf("the previous release's image (%s) built in %v", PreviousTag, time.Since(start).Round(time.Second))
	for i, n := range nodes {
		t.Run("kube-proxy="+n.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
			defer cancel()
			w := newWorld(ctx, t, n.opts, img, prev)
			// The ConfigMap's way to the datapath is the kubelet's and the agent's, whatever
			// kube-proxy does: timed on the first node only, as it takes the kubelet a minute.
			t.Run("kustomize", func(t *testing.T) { w.kustomizeBase(ctx, t, i == 0) })
			if i == 0 { // the API source does not depend on kube-proxy's mode
				t.Run("api-source", func(t *testing.T) { w.apiSource(ctx, t) })
				t.Run("source-selectors", func(t *testing.T) { w.sourceSelectors(ctx, t, backends[0]) })
			}
			for _, b := range backends {
				t.Run("chart/"+b.name, func(t *testing.T) { w.chart(ctx, t, b) })
			}
			for _, b := range backends {
				t.Run("rollout/"+b.name, func(t *testing.T) { w.rollout(ctx, t, b) })
			}
		})
	}
}

// world is one cluster with the outside servers and a client pod.
type world struct {
	c      *cluster.Cluster
	client client // the client pod
	podIP  netip.Addr
	img    agentImage // this tree's
	prev   agentImage // the previous release's
	// iptablesMode is the node's iptables, when the test chose it.
	iptablesMode string
	svcs         *serviceWorld
}

func newWorld(ctx context.Context, t *testing.T, opts cluster.ClusterOptions, img, prev agentImage) *world {
	t.Helper()
	start := time.Now()
	var c *cluster.Cluster
	// Registered before Start's teardown, so it runs after it.
	t.Cleanup(func() {
		if c == nil {
			return
		}
		if err := c.Gone(); err != nil {
			t.Errorf("after teardown: %v", err)
		}
	})
	opts.Images = []string{img.archive, prev.archive}
	c = cluster.Start(t, opts)
	t.Logf("cluster up (kube-proxy %s, iptables %q) in %v", opts.ProxyMode, opts.IptablesMode, time.Since(start).Round(time.Millisecond))
	for _, a := range []netip.Addr{outsideMasq, outsideClient} {
		if _, err := (cluster.Namespaces{}).Run(ctx, 10*time.Second, "ip", "-n", c.Outside, "addr", "add", a.String()+"/32", "dev", "lo"); err != nil {
			t.Fatal(err)
		}
	}
	serveWhoami(t, "/run/netns/"+c.Outside, WhoamiPort, outsideKept, outsideMasq)
	if _, err := c.Client.CoreV1().Pods("default").Create(ctx, cluster.PausePod("client", map[string]string{"app": "client"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod, err := c.WaitPodRunning(ctx, "default", "client")
	if err != nil {
		t.Fatal(err)
	}
	path, err := c.PodNetns(pod.UID)
	if err != nil {
		t.Fatal(err)
	}
	w := &world{c: c, img: img, prev: prev, iptablesMode: opts.IptablesMode, client: client{name: "pod", nsPath: path}, podIP: netip.MustParseAddr(pod.Status.PodIP)}
	w.svcs = w.setUpServices(ctx, t)
	return w
}

// kustomizeBase applies deploy/base as it is (backend auto, the base's configuration), checks
// the pods' traffic against explain (and, with editConfigMap, times a ConfigMap edit), deletes
// it and runs deploy/cleanup.
func (w *world) kustomizeBase(ctx context.Context, t *testing.T, editConfigMap bool) {
	objs := kustomizeApply(ctx, t, w.c, "deploy/base")
	waitDaemonSet(ctx, t, w.c, Release)
	cm, err := w.c.Client.CoreV1().ConfigMaps(Namespace).Get(ctx, "ip-masq-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	w.checkMasquerade(ctx, t, cm.Data["config"])
	t.Logf("agent (kustomize base, backend auto) on %s", installedKind(ctx, t, w.c))
	if editConfigMap {
		t.Run("configmap-edit", func(t *testing.T) { w.editConfigMap(ctx, t, w.findAgent(ctx, t)) })
	}
	kustomizeDelete(ctx, t, w.c, objs)
	waitNoPods(ctx, t, w.c, "app.kubernetes.io/name=ip-masq-agent")
	cleanup := kustomizeApply(ctx, t, w.c, "deploy/cleanup")
	waitDaemonSet(ctx, t, w.c, Release+"-cleanup")
	if kind := installedKind(ctx, t, w.c); kind != "" {
		t.Errorf("after deploy/cleanup the node still has the agent's %s datapath", kind)
	}
	kustomizeDelete(ctx, t, w.c, cleanup)
	w.deleteCleanupPods(ctx, t)
}

// chart installs the chart on backend b, checks the datapath is b's and the pods' traffic is
// what explain says, then uninstalls it and checks the cleanup DaemonSet left nothing.
func (w *world) chart(ctx context.Context, t *testing.T, b backend) {
	helmInstall(t, w.c, w.values(b, w.img))
	start := time.Now()
	waitDaemonSet(ctx, t, w.c, Release)
	t.Logf("agent ready %v after the install", time.Since(start).Round(time.Millisecond))
	w.forgetFlows(t)
	if kind := installedKind(ctx, t, w.c); kind != b.kind {
		t.Errorf("the node has the %q datapath, want %s", kind, b.kind)
	}
	if mode := w.iptablesMode; b.kind == "iptables" && mode != "" {
		// The agent follows kube-proxy's iptables.
		out, err := w.c.NodeNamespaces().Run(ctx, 30*time.Second, "iptables-"+mode+"-save", "-t", "nat")
		if err != nil || !strings.Contains(out, ":IP-MASQ-AGENT") {
			t.Errorf("the agent's chain is not in iptables-%s, kube-proxy's (%v):\n%s", mode, err, out)
		}
	}
	w.checkMasquerade(ctx, t, agentConfig)
	t.Run("services", func(t *testing.T) { w.checkServices(ctx, t, w.svcs, b) })
	t.Run("kubelet-restart", func(t *testing.T) { w.restartKubelet(ctx, t) })
	w.uninstall(ctx, t)
}

// restartKubelet restarts the kubelet under the running agent: the agent's pod must run on
// untouched (same container, no restart) and the pods' traffic keep its verdicts.
func (w *world) restartKubelet(ctx context.Context, t *testing.T) {
	ds, err := w.c.Client.AppsV1().DaemonSets(Namespace).Get(ctx, Release, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	before, err := dsPod(ctx, w.c, ds)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := w.c.RestartKubelet(ctx); err != nil {
		t.Fatal(err)
	}
	// The new kubelet has synced once it renewed the node's lease; the pod is what it made of
	// the running containers.
	wait(ctx, t, "the new kubelet's lease", func() error {
		l, err := w.c.Client.CoordinationV1().Leases("kube-node-lease").Get(ctx, cluster.NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if l.Spec.RenewTime == nil || !l.Spec.RenewTime.After(start) {
			return errors.New("not renewed since the restart")
		}
		return nil
	})
	after := waitDaemonSet(ctx, t, w.c, Release)
	t.Logf("kubelet restarted, agent ready again after %v", time.Since(start).Round(time.Millisecond))
	if after.UID != before.UID || containerID(after) != containerID(before) || restarts(after) != restarts(before) {
		t.Errorf("the agent's pod changed under a kubelet restart: %s %s (%d restarts) -> %s %s (%d restarts)",
			before.UID, containerID(before), restarts(before), after.UID, containerID(after), restarts(after))
	}
	w.checkMasquerade(ctx, t, agentConfig)
}

func containerID(p *corev1.Pod) string {
	if len(p.Status.ContainerStatuses) == 0 {
		return ""
	}
	return p.Status.ContainerStatuses[0].ContainerID
}

func restarts(p *corev1.Pod) int32 {
	if len(p.Status.ContainerStatuses) == 0 {
		return -1
	}
	return p.Status.ContainerStatuses[0].RestartCount
}

// uninstall runs helm uninstall, waits for the cleanup DaemonSet (the chart's post-delete
// hook) to have run, checks the node holds nothing of the agent, and deletes the cleanup.
func (w *world) uninstall(ctx context.Context, t *testing.T) {
	t.Helper()
	helmUninstall(t, w.c)
	waitNoPods(ctx, t, w.c, "app.kubernetes.io/name=ip-masq-agent")
	waitDaemonSet(ctx, t, w.c, Release+"-cleanup")
	if kind := installedKind(ctx, t, w.c); kind != "" {
		t.Errorf("after helm uninstall and the cleanup DaemonSet the node still has the agent's %s datapath", kind)
	}
	if err := w.c.Client.AppsV1().DaemonSets(Namespace).Delete(ctx, Release+"-cleanup", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	w.deleteCleanupPods(ctx, t)
}

// deleteCleanupPods deletes the cleanup DaemonSet's pods at once: their idle container is
// sleep as PID 1, which ignores SIGTERM, so each would otherwise take its whole grace period.
func (w *world) deleteCleanupPods(ctx context.Context, t *testing.T) {
	t.Helper()
	sel := "app.kubernetes.io/name=ip-masq-agent-cleanup"
	if err := w.c.Client.CoreV1().Pods(Namespace).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: new(int64)},
		metav1.ListOptions{LabelSelector: sel}); err != nil {
		t.Fatal(err)
	}
	waitNoPods(ctx, t, w.c, sel)
}

// checkMasquerade connects from the client pod to each outside address over TCP and UDP and
// checks the source the outside saw: the pod's address where explain says RETURN (source
// "pod"), the node's where it says MASQUERADE (source "uplink").
func (w *world) checkMasquerade(ctx context.Context, t *testing.T, config string) {
	t.Helper()
	want := explain(t, config, outsideKept, outsideMasq)
	for _, dst := range []netip.Addr{outsideKept, outsideMasq} {
		expect := w.podIP
		if want[dst] == "uplink" {
			expect = cluster.NodeAddress
		}
		for _, proto := range []string{"tcp", "udp"} {
			got, err := w.client.whoami(ctx, proto, netip.AddrPortFrom(dst, WhoamiPort))
			if err != nil {
				t.Errorf("%s from the pod to %s: %v", proto, dst, err)
				continue
			}
			if got != expect {
				t.Errorf("%s from the pod to %s: the outside saw %s, explain says source %s (%s)", proto, dst, got, want[dst], expect)
			}
		}
	}
}

// explain runs the agent's explain on config and returns each address's SOURCE column.
func explain(t *testing.T, config string, addrs ...netip.Addr) map[netip.Addr]string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "config")
	if err := os.WriteFile(f, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"explain", "--from-file", "--config", f}
	for _, a := range addrs {
		args = append(args, a.String())
	}
	out, err := exec.Command(agentBin(t), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("explain: %v: %s", err, out)
	}
	got := map[netip.Addr]string{}
	for _, line := range strings.Split(string(out), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) < 3 {
			continue
		}
		if a, err := netip.ParseAddr(f[0]); err == nil {
			got[a] = f[2]
		}
	}
	if len(got) != len(addrs) {
		t.Fatalf("explain printed:\n%s", out)
	}
	return got
}

// installedKind says which of the agent's datapaths the node holds: "bpf" (its pins or its
// programs on eth0), "nftables" (its table), "iptables" (its chain, in either iptables mode),
// several joined by "+", or "" for none.
func installedKind(ctx context.Context, t testing.TB, c *cluster.Cluster) string {
	t.Helper()
	run := func(argv ...string) string {
		out, err := c.NodeNamespaces().Run(ctx, 30*time.Second, argv...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	var kinds []string
	pins, err := c.NodeNamespaces().Run(ctx, 10*time.Second, "ls", "-A", "/sys/fs/bpf/")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(pins, "ip-masq-agent") || strings.Contains(run("bpftool", "net", "show", "dev", "eth0"), "tc_egress") {
		kinds = append(kinds, "bpf")
	}
	if strings.Contains(run("nft", "list", "tables"), "ip-masq-agent") {
		kinds = append(kinds, "nftables")
	}
	if strings.Contains(run("iptables-nft-save", "-t", "nat"), ":IP-MASQ-AGENT") ||
		strings.Contains(run("iptables-legacy-save", "-t", "nat"), ":IP-MASQ-AGENT") {
		kinds = append(kinds, "iptables")
	}
	return strings.Join(kinds, "+")
}

// agentImage is the image of this tree's agent, as make image builds it.
type agentImage struct {
	archive, version string
	// tag is the image's tag in the repository image.Repository.
	tag string
	// chart is the release's Helm chart; nil for this tree's.
	chart *chart.Chart
}

// ImageEnv names an archive of the agent's image (make image writes bin/ip-masq-agent-image.tar)
// to run instead of building one, to save the build's minute while working on these tests.
const ImageEnv = "IP_MASQ_AGENT_IMAGE"

// buildAgentImage builds the agent's image from this tree's binary (image.Build, what make
// image runs), or takes $IP_MASQ_AGENT_IMAGE.
func buildAgentImage(t *testing.T) agentImage {
	t.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	v, err := os.ReadFile(filepath.Join(root, "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	version := strings.TrimSpace(string(v))
	if a := os.Getenv(ImageEnv); a != "" {
		return agentImage{archive: a, version: version, tag: version}
	}
	out := filepath.Join(t.TempDir(), "agent.tar")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := image.Build(ctx, image.Options{Spec: image.Runtime, Binary: agentBin(t), Version: version,
		Reference: image.Repository + ":" + version, Epoch: time.Unix(1, 0), Output: out}); err != nil {
		t.Fatal(err)
	}
	return agentImage{archive: out, version: version, tag: version}
}

// agentBin is the agent binary: $IP_MASQ_AGENT_BIN, else the repository's bin/ip-masq-agent
// (make build).
func agentBin(t testing.TB) string {
	t.Helper()
	if b := os.Getenv("IP_MASQ_AGENT_BIN"); b != "" {
		return b
	}
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b := filepath.Join(root, "bin", "ip-masq-agent")
	if _, err := os.Stat(b); err != nil {
		t.Fatalf("no agent binary (make build): %v", err)
	}
	return b
}
