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
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Addresses of the node and its outside world.
var (
	// NodeNet is the link between the node's uplink (eth0, NodeAddress) and the outside
	// namespace (OutsideAddress), the node's default gateway.
	NodeNet        = netip.MustParsePrefix("172.30.0.0/24")
	NodeAddress    = NodeNet.Addr().Next().Next()
	OutsideAddress = NodeNet.Addr().Next()
	// DefaultPodCIDR is the node's pod range (the bridge plugin's host-local range).
	DefaultPodCIDR = netip.MustParsePrefix("10.244.0.0/24")
)

// NodeName is the node's name in the API.
const NodeName = "node-1"

// ProxyModes are the kube-proxy modes a node can run.
var ProxyModes = []string{"iptables", "nftables"}

// Options of a cluster.
type ClusterOptions struct {
	// ProxyMode is kube-proxy's mode: iptables (the default) or nftables.
	ProxyMode string
	// Dir keeps the state; empty means a directory of its own, removed by Close.
	Dir string
	// Images are OCI archives to import into the node's containerd besides the pause image.
	Images []string
	// IptablesMode is the iptables the kubelet and kube-proxy run: "legacy" or "nft" (the
	// iptables-legacy or iptables-nft commands as iptables), empty for the host's default.
	// The agent's iptables backend follows the mode their rules are in.
	IptablesMode string
}

// Cluster is a control plane and one node: the controller manager and the scheduler beside
// the API server, and a node running containerd, the kubelet and kube-proxy in namespaces of
// its own (a network namespace wired to an outside namespace and to the control plane, and a
// mount namespace, see mountns.go), with the bridge CNI plugin for pods.
type Cluster struct {
	*ControlPlane
	// Node is the node's network namespace; Outside the namespace beyond its uplink.
	Node, Outside string
	// CgroupRoot is the kubelet's cgroup root: every pod's cgroups are below it.
	CgroupRoot string
	// ProxyMode is kube-proxy's mode.
	ProxyMode string
	// iptablesEnv is the environment that makes the node's components run IptablesMode.
	iptablesEnv []string

	dir        string
	trace      trace
	mnt        *mountNamespace
	controlled []*Process // controller manager, scheduler
	containerd *Process
	kubelet    *Process
	proxy      *Process
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
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		testutil.Unavailable(t, "no CNI bridge plugin (containernetworking-plugins): %v", err)
	}
	if _, err := Binaries(); err != nil {
		testutil.Unavailable(t, "%v", err)
	}
}

// New brings a cluster up and returns once the node is Ready; Close tears it down.
func New(ctx context.Context, opts ClusterOptions) (_ *Cluster, err error) {
	if opts.ProxyMode == "" {
		opts.ProxyMode = "iptables"
	}
	cp, err := NewControlPlane(ctx, Options{Dir: opts.Dir})
	if err != nil {
		return nil, err
	}
	c := &Cluster{ControlPlane: cp, ProxyMode: opts.ProxyMode, dir: filepath.Join(cp.Dir, "node"),
		trace: trace{hostPaths: existing(hostPaths)}}
	defer func() {
		if err != nil {
			err = errors.Join(err, c.Close())
		}
	}()
	if err := os.MkdirAll(filepath.Join(c.dir, "cni"), 0o755); err != nil {
		return nil, err
	}
	c.CgroupRoot = cp.run.cgroupRoot()
	if c.iptablesEnv, err = iptablesMode(c.dir, opts.IptablesMode); err != nil {
		return nil, err
	}
	steps := []func(context.Context) error{
		c.startControllers, c.wireNode, c.makeMountNamespace, c.startContainerd,
		func(context.Context) error { return c.record() },
	}
	for _, step := range steps {
		if err := step(ctx); err != nil {
			return nil, err
		}
	}
	pause, err := BuildPause(ctx, c.dir)
	if err != nil {
		return nil, err
	}
	if err := c.Import(ctx, append([]string{pause}, opts.Images...)...); err != nil {
		return nil, err
	}
	for _, step := range []func(context.Context) error{c.startKubelet, c.startProxy, c.waitNodeReady, c.waitServiceAccount} {
		if err := step(ctx); err != nil {
			return nil, err
		}
	}
	return c, nil
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

// kubeconfig issues a client certificate and writes its kubeconfig under the node's directory.
func (c *Cluster) kubeconfig(name, user string, groups ...string) (string, error) {
	pair, err := c.PKI.Issue(name, Cert{CommonName: user, Groups: groups})
	if err != nil {
		return "", err
	}
	path := filepath.Join(c.dir, name+".kubeconfig")
	return path, writeKubeconfig(path, c.URL, c.PKI.CAFile, user, pair)
}

// startControllers runs the controller manager (without it no DaemonSet has pods, no
// ServiceAccount exists) and the scheduler (without it no pod is placed) beside the API server,
// each as its own default RBAC identity.
func (c *Cluster) startControllers(context.Context) error {
	cm, err := c.kubeconfig("controller-manager", "system:kube-controller-manager")
	if err != nil {
		return err
	}
	sched, err := c.kubeconfig("scheduler", "system:kube-scheduler")
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

// wireNode makes the node's network namespace: its uplink eth0 to the outside namespace (its
// default gateway, which routes the pod range and the Services back to it), a link to the
// control plane, and forwarding on.
func (c *Cluster) wireNode(ctx context.Context) error {
	var err error
	if c.Node, err = c.run.newNetns(ctx, "node"); err != nil {
		return err
	}
	if c.Outside, err = c.run.newNetns(ctx, "out"); err != nil {
		return err
	}
	l := Link{NsA: c.Outside, NameA: "eth0", NsB: c.Node, NameB: "eth0", Net: NodeNet}
	if err := l.create(ctx); err != nil {
		return err
	}
	if _, err := ip(ctx, "-n", c.Node, "route", "add", "default", "via", OutsideAddress.String()); err != nil {
		return err
	}
	for _, p := range append([]netip.Prefix{DefaultPodCIDR}, c.opts.ServiceCIDRs...) {
		if err := route(ctx, c.Outside, p, NodeAddress); err != nil {
			return err
		}
	}
	// The control plane reaches the pods and the kubelet (logs, exec) through the link.
	if _, err := c.Attach(ctx, c.Node, DefaultPodCIDR, netip.PrefixFrom(NodeAddress, 32)); err != nil {
		return err
	}
	_, err = Namespaces{Net: netnsPath(c.Node)}.Run(ctx, cmdTimeout, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
	return err
}

func (c *Cluster) makeMountNamespace(ctx context.Context) error {
	var err error
	c.mnt, err = newMountNamespace(ctx, c.Node, c.dir)
	return err
}

// NodeNamespaces are the node's network and mount namespaces, for running a command on the
// node (NodeNamespaces().Run(ctx, timeout, "nft", "list", "ruleset")).
func (c *Cluster) NodeNamespaces() Namespaces {
	return Namespaces{Net: netnsPath(c.Node), Mount: c.mnt.path()}
}

// MountHolder is the pid of the process that holds the node's mount namespace
// (/proc/PID/ns/mnt).
func (c *Cluster) MountHolder() string { return strconv.Itoa(c.mnt.holder.Pid()) }

func (c *Cluster) startContainerd(ctx context.Context) error {
	if err := os.WriteFile(filepath.Join(c.dir, "cni", "10-pods.conflist"), []byte(cniConfig([]netip.Prefix{DefaultPodCIDR})), 0o644); err != nil {
		return err
	}
	conf := filepath.Join(c.dir, "containerd.toml")
	if err := os.WriteFile(conf, []byte(containerdConfig(filepath.Join(c.dir, "cni"), PauseRef)), 0o644); err != nil {
		return err
	}
	var err error
	if c.containerd, err = startProcess("containerd", c.logPath("containerd"), c.NodeNamespaces(), nil,
		"containerd", "--config="+conf); err != nil {
		return err
	}
	return poll(ctx, "containerd", c.containerd, func() error {
		_, err := c.NodeNamespaces().Run(ctx, cmdTimeout, "ctr", "version")
		return err
	})
}

// Import imports OCI image archives into the node's containerd, where the kubelet finds them
// (pods run them with imagePullPolicy Never or IfNotPresent).
func (c *Cluster) Import(ctx context.Context, archives ...string) error {
	for _, a := range archives {
		if _, err := c.NodeNamespaces().Run(ctx, 5*time.Minute, "ctr", "-n", "k8s.io", "images", "import", "--no-unpack=false", a); err != nil {
			return fmt.Errorf("import %s: %w", a, err)
		}
	}
	return nil
}

func (c *Cluster) startKubelet(context.Context) error {
	kc, err := c.kubeconfig("kubelet", "system:node:"+NodeName, "system:nodes")
	if err != nil {
		return err
	}
	resolv := filepath.Join(c.dir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver "+OutsideAddress.String()+"\n"), 0o644); err != nil {
		return err
	}
	conf := filepath.Join(c.dir, "kubelet.yaml")
	if err := os.WriteFile(conf, []byte(kubeletConfig(c.PKI.CAFile, c.CgroupRoot, resolv)), 0o644); err != nil {
		return err
	}
	if err := makeCgroups(c.CgroupRoot); err != nil {
		return err
	}
	return c.runKubelet(kc, conf)
}

func (c *Cluster) runKubelet(kubeconfig, conf string) error {
	var err error
	c.kubelet, err = startProcess("kubelet", c.logPath("kubelet"), c.NodeNamespaces(), c.iptablesEnv,
		filepath.Join(c.Bin, "kubelet"), "--config="+conf, "--kubeconfig="+kubeconfig,
		"--hostname-override="+NodeName, "--node-ip="+NodeAddress.String(), "--v=1")
	return err
}

// RestartKubelet stops the kubelet (SIGTERM) and starts it again; the pods run on.
func (c *Cluster) RestartKubelet(ctx context.Context) error {
	if err := c.kubelet.Stop(20 * time.Second); err != nil {
		return err
	}
	return c.runKubelet(filepath.Join(c.dir, "kubelet.kubeconfig"), filepath.Join(c.dir, "kubelet.yaml"))
}

func (c *Cluster) startProxy(context.Context) error {
	kc, err := c.kubeconfig("kube-proxy", "system:kube-proxy")
	if err != nil {
		return err
	}
	conf := filepath.Join(c.dir, "kube-proxy.yaml")
	if err := os.WriteFile(conf, []byte(kubeProxyConfig(c.ProxyMode, kc, NodeName, []netip.Prefix{DefaultPodCIDR})), 0o644); err != nil {
		return err
	}
	c.proxy, err = startProcess("kube-proxy", c.logPath("kube-proxy"), c.NodeNamespaces(), c.iptablesEnv,
		filepath.Join(c.Bin, "kube-proxy"), "--config="+conf)
	return err
}

// waitNodeReady waits until the node is registered and Ready (its runtime and network up).
func (c *Cluster) waitNodeReady(ctx context.Context) error {
	return poll(ctx, "node "+NodeName+" ready", c.kubelet, func() error {
		n, err := c.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				if cond.Status == corev1.ConditionTrue {
					return nil
				}
				return fmt.Errorf("%s: %s", cond.Reason, cond.Message)
			}
		}
		return errors.New("no Ready condition yet")
	})
}

// waitServiceAccount waits for the controller manager to make the default namespace's
// ServiceAccount, without which no pod is admitted there.
func (c *Cluster) waitServiceAccount(ctx context.Context) error {
	return poll(ctx, "default ServiceAccount", c.controlled[0], func() error {
		_, err := c.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err
	})
}

// poll calls cond until it succeeds, p (when set) ends, or readyTimeout passes.
func poll(ctx context.Context, what string, p *Process, cond func() error) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	for {
		if p != nil {
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

// Close tears the cluster down: the node's components, then every process left in the node's
// namespaces or cgroups (the pods' processes, containerd's shims), the cgroups, the mount
// namespace, the network namespaces, the control plane; then it notes what processes are left
// in them (for Gone). After a failed teardown the run directory stays, for a later run's Reap.
func (c *Cluster) Close() error {
	err := c.teardown()
	c.trace.checkLeft()
	return errors.Join(err, c.run.end(err == nil && len(c.trace.left) == 0))
}

func (c *Cluster) teardown() error {
	var errs []error
	for _, p := range []*Process{c.proxy, c.kubelet, c.containerd} {
		if p != nil {
			errs = append(errs, p.Stop(5*time.Second))
		}
	}
	if c.Node != "" {
		errs = append(errs, c.killLeftovers())
	}
	if c.mnt != nil {
		errs = append(errs, c.mnt.close())
	}
	for _, p := range c.controlled {
		errs = append(errs, p.Stop(5*time.Second))
	}
	for _, ns := range []string{c.Node, c.Outside} {
		if ns != "" {
			errs = append(errs, testutil.DeleteNetns(context.Background(), ns))
		}
	}
	errs = append(errs, c.ControlPlane.teardown())
	return errors.Join(errs...)
}

// LogTails logs the end of each component's log.
func (c *Cluster) LogTails(t testing.TB) {
	c.ControlPlane.logTails(t)
	for _, p := range append(c.controlled, c.containerd, c.kubelet, c.proxy) {
		if p != nil {
			t.Logf("%s log (%s) ends:\n%s", p.Name, p.Log, p.Tail(40))
		}
	}
}
