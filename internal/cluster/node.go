package cluster

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Addresses of the nodes and their outside world.
var (
	// NodeNet is the nodes' network: each node's uplink (eth0) is on it, and the outside
	// namespace holds its first address (OutsideAddress) on a bridge, every node's default
	// gateway. Node N (from 1) has the address N+1: NodeAddress is node 1's.
	NodeNet        = netip.MustParsePrefix("172.30.0.0/24")
	NodeAddress    = NodeNet.Addr().Next().Next()
	OutsideAddress = NodeNet.Addr().Next()
	// ClusterPodCIDR holds every node's pod range: node N's is its (N-1)th /24, each node's
	// bridge plugin's host-local range. DefaultPodCIDR is node 1's.
	ClusterPodCIDR = netip.MustParsePrefix("10.244.0.0/16")
	DefaultPodCIDR = netip.MustParsePrefix("10.244.0.0/24")
)

// NodeName is node 1's name in the API (node N's is "node-N").
const NodeName = "node-1"

// maxNodes bounds ClusterOptions.Nodes: the addresses of NodeNet, the /24s of ClusterPodCIDR
// and the control plane's Attach pairs all run out a little above it.
const maxNodes = 200

// ProxyModes are the kube-proxy modes a node can run.
var ProxyModes = []string{"iptables", "nftables"}

// Options of a cluster.
type ClusterOptions struct {
	// ProxyMode is kube-proxy's mode: iptables (the default) or nftables.
	ProxyMode string
	// Dir keeps the state; empty means a directory of its own, removed by Close.
	Dir string
	// Images are OCI archives to import into every node's containerd besides the pause image.
	Images []string
	// IptablesMode is the iptables the kubelet, kube-proxy and the CNI plugins run: "legacy" or
	// "nft" (the iptables-legacy or iptables-nft commands as iptables), empty for the host's
	// default. The agent's iptables backend follows the mode their rules are in.
	IptablesMode string
	// Nodes is the number of nodes; 0 means 1.
	Nodes int
	// DNS deploys CoreDNS (see dns.go): New returns once it is ready at DNSAddress.
	DNS bool
	// OutsideAddrs are more addresses of the outside namespace (on its loopback), which the
	// nodes reach by their default route: a test's stand-in for a host on the Internet.
	OutsideAddrs []netip.Prefix
}

// Cluster is a control plane and its nodes: the controller manager and the scheduler beside
// the API server, and nodes running containerd, the kubelet and kube-proxy in namespaces of
// their own (a network namespace wired to the outside namespace and to the control plane, and
// a mount namespace, see mountns.go), with the bridge CNI plugin for pods. The nodes share one
// network, so each routes the others' pod ranges to them directly, nothing translated.
type Cluster struct {
	*ControlPlane
	// Nodes are the nodes, node 1 first.
	Nodes []*Node
	// Node is node 1's network namespace; Outside the namespace beyond the nodes' uplinks.
	Node, Outside string
	// CgroupRoot holds the nodes' cgroup roots: every pod's cgroups are below it.
	CgroupRoot string
	// ProxyMode is kube-proxy's mode.
	ProxyMode string
	// iptablesEnv is the environment that makes the nodes' components run IptablesMode.
	iptablesEnv []string

	dir        string // the state the nodes share (node 1's directory)
	trace      trace
	controlled []*Process // controller manager, scheduler
}

// Node is one node: containerd, the kubelet and kube-proxy in a network namespace and a mount
// namespace of their own.
type Node struct {
	// Name is the node's name in the API: node-N.
	Name string
	// Netns is the node's network namespace.
	Netns string
	// Address is the node's uplink address (eth0, on NodeNet), its InternalIP.
	Address netip.Addr
	// PodCIDR is the node's pod range.
	PodCIDR netip.Prefix
	// CgroupRoot is the node's kubelet's cgroup root, below the cluster's.
	CgroupRoot string

	index      int    // N, from 1
	dir        string // the node's state
	mnt        *mountNamespace
	containerd *Process
	kubelet    *Process
	proxy      *Process
}

// newNode describes node N (from 1) of the cluster c; nothing is made yet.
func (c *Cluster) newNode(index int) *Node {
	pods := ClusterPodCIDR.Addr().As4()
	pods[2] = byte(index - 1)
	name := fmt.Sprintf("node-%d", index)
	return &Node{
		Name:       name,
		Address:    addrAdd(NodeNet.Addr(), index+1),
		PodCIDR:    netip.PrefixFrom(netip.AddrFrom4(pods), 24),
		CgroupRoot: c.CgroupRoot + "/" + name,
		index:      index,
		dir:        filepath.Join(c.ControlPlane.Dir, n1(index, "node", name)),
	}
}

// n1 is what names a node's network namespace, directory, logs and certificates: one for
// node 1, whose names are a single-node cluster's as they were before there were more nodes,
// another for the others.
func n1(index int, first, other string) string {
	if index == 1 {
		return first
	}
	return other
}

// own names a file, log or certificate of the node: base for node 1, base-NAME for the others.
func (n *Node) own(base string) string { return n1(n.index, base, base+"-"+n.Name) }

// addrAdd is a + n.
func addrAdd(a netip.Addr, n int) netip.Addr {
	for range n {
		a = a.Next()
	}
	return a
}

// Start brings a cluster up for the test and tears it down when the test ends; see
// StartControlPlane for what a machine without the tools does and for Reap.
func Start(t testing.TB, opts ClusterOptions) *Cluster {
	t.Helper()
	Require(t)
	reapT(t)
	c, err := New(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			c.LogTails(t)
		}
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	})
	return c
}

// Require stops a test on a machine that cannot run a cluster (no root, no etcd, containerd,
// CNI plugins or Kubernetes binaries): a skip outside CI, a failure in CI.
func Require(t testing.TB) {
	t.Helper()
	testutil.RequirePrivileged(t, "etcd", "containerd", "ctr", "runc", "nsenter", "unshare", "ip")
	if _, err := os.Stat(filepath.Join(cniBinDir, "bridge")); err != nil {
		testutil.Unavailable(t, "no CNI bridge plugin (containernetworking-plugins): %v", err)
	}
	if _, err := Binaries(); err != nil {
		testutil.Unavailable(t, "%v", err)
	}
}

// RequireDNS is Require for a cluster with ClusterOptions.DNS: it also needs the CoreDNS
// binary (make coredns).
func RequireDNS(t testing.TB) {
	t.Helper()
	Require(t)
	if _, err := CoreDNSBinary(); err != nil {
		testutil.Unavailable(t, "%v", err)
	}
}

// New brings a cluster up and returns once every node is Ready (and CoreDNS, with
// ClusterOptions.DNS); Close tears it down.
func New(ctx context.Context, opts ClusterOptions) (_ *Cluster, err error) {
	if opts.ProxyMode == "" {
		opts.ProxyMode = "iptables"
	}
	nodes := max(opts.Nodes, 1)
	if nodes > maxNodes {
		return nil, fmt.Errorf("%d nodes: at most %d", nodes, maxNodes)
	}
	images := opts.Images
	if opts.DNS {
		// Found before anything starts: a missing binary fails at once, saying how to build it.
		if _, err := CoreDNSBinary(); err != nil {
			return nil, err
		}
	}
	cp, err := NewControlPlane(ctx, Options{Dir: opts.Dir})
	if err != nil {
		return nil, err
	}
	c := &Cluster{ControlPlane: cp, ProxyMode: opts.ProxyMode, dir: filepath.Join(cp.Dir, "node"),
		CgroupRoot: cp.run.cgroupRoot(), trace: trace{hostPaths: existing(hostPaths)}}
	defer func() {
		if err != nil {
			err = errors.Join(err, c.Close())
		}
	}()
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return nil, err
	}
	if c.iptablesEnv, err = iptablesMode(c.dir, opts.IptablesMode); err != nil {
		return nil, err
	}
	if err := c.startControllers(ctx); err != nil {
		return nil, err
	}
	if err := c.wireOutside(ctx, opts.OutsideAddrs); err != nil {
		return nil, err
	}
	for i := 1; i <= nodes; i++ {
		if err := c.addNode(ctx, c.newNode(i)); err != nil {
			return nil, err
		}
	}
	if err := c.record(); err != nil {
		return nil, err
	}
	pause, err := BuildPause(ctx, c.dir)
	if err != nil {
		return nil, err
	}
	images = append([]string{pause}, images...)
	if opts.DNS {
		dns, err := BuildCoreDNS(c.dir)
		if err != nil {
			return nil, err
		}
		images = append(images, dns)
	}
	if err := c.Import(ctx, images...); err != nil {
		return nil, err
	}
	for _, n := range c.Nodes {
		if err := c.startKubelet(n); err != nil {
			return nil, err
		}
		if err := c.startProxy(n); err != nil {
			return nil, err
		}
	}
	for _, n := range c.Nodes {
		if err := c.waitNodeReady(ctx, n); err != nil {
			return nil, err
		}
	}
	if err := c.waitServiceAccount(ctx); err != nil {
		return nil, err
	}
	if opts.DNS {
		return c, c.startDNS(ctx)
	}
	return c, nil
}

// addNode makes node n: its network namespace and wiring, its mount namespace and containerd.
// The node is the cluster's from the start, so that a failure's Close removes what was made.
func (c *Cluster) addNode(ctx context.Context, n *Node) error {
	c.Nodes = append(c.Nodes, n)
	if err := os.MkdirAll(filepath.Join(n.dir, "cni"), 0o755); err != nil {
		return err
	}
	if err := c.wireNode(ctx, n); err != nil {
		return err
	}
	if n.index == 1 {
		c.Node = n.Netns
	}
	var err error
	if n.mnt, err = newMountNamespace(ctx, n.Netns, n.dir, n.Name); err != nil {
		return err
	}
	return c.startContainerd(ctx, n)
}

// iptablesMode returns the environment in which iptables is iptables-MODE: a directory of
// links first on PATH (what update-alternatives does for the whole host, done for the node's
// components alone). An empty mode changes nothing.
func iptablesMode(dir, mode string) ([]string, error) {
	if mode == "" {
		return nil, nil
	}
	bin := filepath.Join(dir, "iptables-"+mode)
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return nil, err
	}
	for _, fam := range []string{"iptables", "ip6tables"} {
		for _, suffix := range []string{"", "-save", "-restore"} {
			target, err := exec.LookPath(fam + "-" + mode + suffix)
			if err != nil {
				return nil, fmt.Errorf("iptables mode %s: %w", mode, err)
			}
			if err := os.Symlink(target, filepath.Join(bin, fam+suffix)); err != nil {
				return nil, err
			}
		}
	}
	return []string{"PATH=" + bin + ":" + os.Getenv("PATH")}, nil
}

// kubeconfig issues a client certificate named name and writes its kubeconfig in dir.
func (c *Cluster) kubeconfig(dir, name, user string, groups ...string) (string, error) {
	pair, err := c.PKI.Issue(name, Cert{CommonName: user, Groups: groups})
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, name+".kubeconfig")
	return path, writeKubeconfig(path, c.URL, c.PKI.CAFile, user, pair)
}

// startControllers runs the controller manager (without it no DaemonSet has pods, no
// ServiceAccount exists) and the scheduler (without it no pod is placed) beside the API server,
// each as its own default RBAC identity.
func (c *Cluster) startControllers(context.Context) error {
	cm, err := c.kubeconfig(c.dir, "controller-manager", "system:kube-controller-manager")
	if err != nil {
		return err
	}
	sched, err := c.kubeconfig(c.dir, "scheduler", "system:kube-scheduler")
	if err != nil {
		return err
	}
	pki := c.PKI.Dir
	p, err := startProcess("kube-controller-manager", c.logPath("kube-controller-manager"), c.ns(), nil,
		filepath.Join(c.Bin, "kube-controller-manager"), "--kubeconfig="+cm,
		"--authentication-kubeconfig="+cm, "--authorization-kubeconfig="+cm,
		"--service-account-private-key-file="+filepath.Join(pki, "sa.key"), "--root-ca-file="+c.PKI.CAFile,
		"--use-service-account-credentials=true", "--leader-elect=false",
		"--bind-address=127.0.0.1", "--cert-dir="+filepath.Join(c.dir, "controller-manager"),
		"--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-persistentvolume-binder,-attachdetach",
		"--node-monitor-grace-period=40s")
	if err != nil {
		return err
	}
	c.controlled = append(c.controlled, p)
	p, err = startProcess("kube-scheduler", c.logPath("kube-scheduler"), c.ns(), nil,
		filepath.Join(c.Bin, "kube-scheduler"), "--kubeconfig="+sched,
		"--authentication-kubeconfig="+sched, "--authorization-kubeconfig="+sched,
		"--leader-elect=false", "--bind-address=127.0.0.1")
	if err != nil {
		return err
	}
	c.controlled = append(c.controlled, p)
	return nil
}

// wireOutside makes the outside namespace: a bridge holding OutsideAddress, which each node's
// uplink joins (wireNode), and the extra addresses on its loopback.
func (c *Cluster) wireOutside(ctx context.Context, addrs []netip.Prefix) error {
	var err error
	if c.Outside, err = c.run.newNetns(ctx, "out"); err != nil {
		return err
	}
	cmds := [][]string{
		{"link", "add", outsideBridge, "type", "bridge"},
		{"addr", "add", netip.PrefixFrom(OutsideAddress, NodeNet.Bits()).String(), "dev", outsideBridge},
		{"link", "set", outsideBridge, "up"},
	}
	for _, a := range addrs {
		cmds = append(cmds, []string{"addr", "add", a.String(), "dev", "lo"})
	}
	for _, cmd := range cmds {
		if _, err := ip(ctx, append([]string{"-n", c.Outside}, cmd...)...); err != nil {
			return err
		}
	}
	return nil
}

// outsideBridge is the outside namespace's bridge, the nodes' network.
const outsideBridge = "br0"

// wireNode makes node n's network namespace: its uplink eth0 on the outside's bridge (its
// default gateway, which routes the node's pod range back to it, and the Services to node 1),
// routes to the other nodes' pod ranges through them, a link to the control plane (which routes
// the node's address and pod range through it: logs, exec, proxying to pods), and forwarding on.
func (c *Cluster) wireNode(ctx context.Context, n *Node) error {
	var err error
	if n.Netns, err = c.run.newNetns(ctx, n1(n.index, "node", n.Name)); err != nil {
		return err
	}
	// The peer is made in the node directly, so its name need only be free there.
	cmds := [][]string{
		{"-n", c.Outside, "link", "add", n.Name, "type", "veth", "peer", "name", "eth0", "netns", n.Netns},
		{"-n", c.Outside, "link", "set", n.Name, "master", outsideBridge, "up"},
		{"-n", n.Netns, "addr", "add", netip.PrefixFrom(n.Address, NodeNet.Bits()).String(), "dev", "eth0"},
		{"-n", n.Netns, "link", "set", "eth0", "up"},
		{"-n", n.Netns, "route", "add", "default", "via", OutsideAddress.String()},
	}
	for _, cmd := range cmds {
		if _, err := ip(ctx, cmd...); err != nil {
			return err
		}
	}
	outside := []netip.Prefix{n.PodCIDR}
	if n.index == 1 {
		outside = append(outside, c.opts.ServiceCIDRs...)
	}
	for _, p := range outside {
		if err := route(ctx, c.Outside, p, n.Address); err != nil {
			return err
		}
	}
	for _, m := range c.Nodes {
		if m == n {
			continue
		}
		if err := route(ctx, n.Netns, m.PodCIDR, m.Address); err != nil {
			return err
		}
		if err := route(ctx, m.Netns, n.PodCIDR, n.Address); err != nil {
			return err
		}
	}
	if _, err := c.Attach(ctx, n.Netns, n.PodCIDR, netip.PrefixFrom(n.Address, 32)); err != nil {
		return err
	}
	_, err = Namespaces{Net: netnsPath(n.Netns)}.Run(ctx, cmdTimeout, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
	return err
}

// Namespaces are the node's network, mount and UTS namespaces, for running a command on the node
// (Namespaces().Run(ctx, timeout, "nft", "list", "ruleset")).
func (n *Node) Namespaces() Namespaces {
	return Namespaces{Net: netnsPath(n.Netns), Mount: n.mnt.path(), UTS: n.mnt.utsPath()}
}

// MountHolder is the pid of the process that holds the node's mount namespace
// (/proc/PID/ns/mnt).
func (n *Node) MountHolder() string { return strconv.Itoa(n.mnt.holder.Pid()) }

// NodeNamespaces are node 1's namespaces (Node.Namespaces).
func (c *Cluster) NodeNamespaces() Namespaces { return c.Nodes[0].Namespaces() }

// MountHolder is the pid of the process that holds node 1's mount namespace.
func (c *Cluster) MountHolder() string { return c.Nodes[0].MountHolder() }

func (c *Cluster) startContainerd(ctx context.Context, n *Node) error {
	cni := filepath.Join(n.dir, "cni")
	if err := os.WriteFile(filepath.Join(cni, "10-pods.conflist"), []byte(cniConfig([]netip.Prefix{n.PodCIDR}, portmap())), 0o644); err != nil {
		return err
	}
	conf := filepath.Join(n.dir, "containerd.toml")
	if err := os.WriteFile(conf, []byte(containerdConfig(cni, PauseRef)), 0o644); err != nil {
		return err
	}
	var err error
	// The CNI plugins it runs (portmap) write iptables rules: in the mode of kube-proxy's.
	if n.containerd, err = startProcess(n.own("containerd"), c.logPath(n.own("containerd")), n.Namespaces(), c.iptablesEnv,
		"containerd", "--config="+conf); err != nil {
		return err
	}
	return poll(ctx, n.Name+"'s containerd", func() error {
		_, err := n.Namespaces().Run(ctx, cmdTimeout, "ctr", "version")
		return err
	}, n.containerd)
}

// Import imports OCI image archives into every node's containerd, where the kubelet finds them
// (pods run them with imagePullPolicy Never or IfNotPresent). The nodes import at once.
func (c *Cluster) Import(ctx context.Context, archives ...string) error {
	errs := make([]error, len(c.Nodes))
	var wg sync.WaitGroup
	for i, n := range c.Nodes {
		wg.Go(func() { errs[i] = n.importImages(ctx, archives) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (n *Node) importImages(ctx context.Context, archives []string) error {
	for _, a := range archives {
		if _, err := n.Namespaces().Run(ctx, 5*time.Minute, "ctr", "-n", "k8s.io", "images", "import", "--no-unpack=false", a); err != nil {
			return fmt.Errorf("import %s into %s: %w", a, n.Name, err)
		}
	}
	return nil
}

// kubeletFiles are node n's kubelet's kubeconfig and configuration file.
func (n *Node) kubeletFiles() (kubeconfig, conf string) {
	return filepath.Join(n.dir, n.own("kubelet")+".kubeconfig"), filepath.Join(n.dir, "kubelet.yaml")
}

func (c *Cluster) startKubelet(n *Node) error {
	if _, err := c.kubeconfig(n.dir, n.own("kubelet"), "system:node:"+n.Name, "system:nodes"); err != nil {
		return err
	}
	resolv := filepath.Join(n.dir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver "+OutsideAddress.String()+"\n"), 0o644); err != nil {
		return err
	}
	_, conf := n.kubeletFiles()
	if err := os.WriteFile(conf, []byte(kubeletConfig(c.PKI.CAFile, n.CgroupRoot, resolv)), 0o644); err != nil {
		return err
	}
	if err := makeCgroups(n.CgroupRoot); err != nil {
		return err
	}
	return c.runKubelet(n)
}

func (c *Cluster) runKubelet(n *Node) error {
	kc, conf := n.kubeletFiles()
	var err error
	n.kubelet, err = startProcess(n.own("kubelet"), c.logPath(n.own("kubelet")), n.Namespaces(), c.iptablesEnv,
		filepath.Join(c.Bin, "kubelet"), "--config="+conf, "--kubeconfig="+kc,
		"--hostname-override="+n.Name, "--node-ip="+n.Address.String(), "--v=1")
	return err
}

// RestartKubelet stops every node's kubelet (SIGTERM) and starts it again; the pods run on.
func (c *Cluster) RestartKubelet(ctx context.Context) error {
	for _, n := range c.Nodes {
		if err := n.kubelet.Stop(20 * time.Second); err != nil {
			return err
		}
		if err := c.runKubelet(n); err != nil {
			return err
		}
	}
	return nil
}

// startProxy runs node n's kube-proxy. Its cluster CIDR is every node's pods': a pod of
// another node reaching a Service is a pod, not an outside client to masquerade.
func (c *Cluster) startProxy(n *Node) error {
	kc, err := c.kubeconfig(n.dir, n.own("kube-proxy"), "system:kube-proxy")
	if err != nil {
		return err
	}
	conf := filepath.Join(n.dir, "kube-proxy.yaml")
	if err := os.WriteFile(conf, []byte(kubeProxyConfig(c.ProxyMode, kc, n.Name, []netip.Prefix{ClusterPodCIDR})), 0o644); err != nil {
		return err
	}
	n.proxy, err = startProcess(n.own("kube-proxy"), c.logPath(n.own("kube-proxy")), n.Namespaces(), c.iptablesEnv,
		filepath.Join(c.Bin, "kube-proxy"), "--config="+conf)
	return err
}

// waitNodeReady waits until node n is registered and Ready (its runtime and network up).
func (c *Cluster) waitNodeReady(ctx context.Context, n *Node) error {
	return poll(ctx, "node "+n.Name+" ready", func() error {
		node, err := c.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				if cond.Status == corev1.ConditionTrue {
					return nil
				}
				return fmt.Errorf("%s: %s", cond.Reason, cond.Message)
			}
		}
		return errors.New("no Ready condition yet")
	}, n.kubelet)
}

// waitServiceAccount waits for the controller manager to make the default namespace's
// ServiceAccount, without which no pod is admitted there.
func (c *Cluster) waitServiceAccount(ctx context.Context) error {
	return poll(ctx, "default ServiceAccount", func() error {
		_, err := c.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err
	}, c.controlled[0])
}

// kubelets are the nodes' kubelets, for polls that end when one does.
func (c *Cluster) kubelets() []*Process {
	var ps []*Process
	for _, n := range c.Nodes {
		ps = append(ps, n.kubelet)
	}
	return ps
}

// poll calls cond until it succeeds, one of ps (those set) ends, or readyTimeout passes.
func poll(ctx context.Context, what string, cond func() error, ps ...*Process) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	for {
		for _, p := range ps {
			if p == nil {
				continue
			}
			if err := p.alive(); err != nil {
				return err
			}
		}
		err := cond()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: not within %v: %w", what, readyTimeout, err)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// Close tears the cluster down: each node's components, then every process left in the node's
// namespaces or cgroups (the pods' processes, containerd's shims), its cgroups and mount
// namespace; the network namespaces, the control plane; then it notes what processes are left
// in them (for Gone). After a failed teardown the run directory stays, for a later run's Reap.
func (c *Cluster) Close() error {
	err := c.teardown()
	c.trace.checkLeft()
	return errors.Join(err, c.run.end(err == nil && len(c.trace.left) == 0))
}

func (c *Cluster) teardown() error {
	var errs []error
	for _, n := range c.Nodes {
		errs = append(errs, n.teardown())
	}
	errs = append(errs, removeCgroups(c.CgroupRoot))
	for _, p := range c.controlled {
		errs = append(errs, p.Stop(5*time.Second))
	}
	for _, n := range c.Nodes {
		if n.Netns != "" {
			errs = append(errs, testutil.DeleteNetns(context.Background(), n.Netns))
		}
	}
	if c.Outside != "" {
		errs = append(errs, testutil.DeleteNetns(context.Background(), c.Outside))
	}
	errs = append(errs, c.ControlPlane.teardown())
	return errors.Join(errs...)
}

// teardown stops the node's components, kills what is left of it and ends its mount namespace.
func (n *Node) teardown() error {
	var errs []error
	for _, p := range []*Process{n.proxy, n.kubelet, n.containerd} {
		if p != nil {
			errs = append(errs, p.Stop(5*time.Second))
		}
	}
	if n.Netns != "" {
		errs = append(errs, n.killLeftovers())
	}
	if n.mnt != nil {
		errs = append(errs, n.mnt.close())
	}
	return errors.Join(errs...)
}

// LogTails logs the end of each component's log.
func (c *Cluster) LogTails(t testing.TB) {
	c.ControlPlane.logTails(t)
	ps := append([]*Process(nil), c.controlled...)
	for _, n := range c.Nodes {
		ps = append(ps, n.containerd, n.kubelet, n.proxy)
	}
	for _, p := range ps {
		if p != nil {
			t.Logf("%s log (%s) ends:\n%s", p.Name, p.Log, p.Tail(40))
		}
	}
}
