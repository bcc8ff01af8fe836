// Package cluster runs a real Kubernetes cluster for the project's tests, entirely inside
// namespaces it creates: etcd and kube-apiserver (the control plane, this file), and a node
// (containerd, kubelet, kube-proxy, ...) beside it. The components are the ones `make k8s`
// builds (Binaries); certificates are made here with Go's crypto (PKI).
//
// A test that needs only an API server:
//
//	cp := cluster.StartControlPlane(t, cluster.Options{})
//	cp.Client.CoreV1().ConfigMaps("default").Create(ctx, cm, metav1.CreateOptions{})
//	addr := cp.Attach(t, nodeNetns) // a namespace of the test's, now routed to the API server
//	// run an agent in nodeNetns with --kubeconfig=cp.Kubeconfig (or cp.UserKubeconfig(...))
//	cp.RestartAPIServer(ctx)        // the API server goes away and comes back; etcd keeps the data
package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Addresses of the control plane's network namespace.
var (
	// APIAddress is where the API server serves, on its namespace's loopback: every namespace
	// Attach connects reaches it by a route.
	APIAddress = netip.MustParseAddr("10.255.255.1")
	// attachNet holds the /30 of each Attach: 10.255.N.0/30, N = 0, 1, ...
	attachNet = netip.MustParsePrefix("10.255.0.0/16")
	// DefaultServiceCIDR is the Services' range; its first address is the "kubernetes"
	// Service's ClusterIP, which the API server's certificate names.
	DefaultServiceCIDR = netip.MustParsePrefix("10.96.0.0/16")
)

// APIPort is the API server's secure port.
const APIPort = 6443

// readyTimeout bounds each wait for a component to become ready: a liveness bound, far above
// the few seconds they take.
const readyTimeout = 90 * time.Second

// Options shape a control plane; the zero value is a good one.
type Options struct {
	// Dir keeps the state (certificates, etcd's data, logs); empty means a directory of its own,
	// removed by Close.
	Dir string
	// ServiceCIDRs are the Services' ranges (one per family); empty means DefaultServiceCIDR.
	ServiceCIDRs []netip.Prefix
}

// ControlPlane is etcd and kube-apiserver running in a network namespace of their own.
type ControlPlane struct {
	// Netns is the network namespace the control plane runs in.
	Netns string
	// URL is the API server's address, https://APIAddress:APIPort.
	URL string
	// Dir holds the state; Bin the Kubernetes binaries.
	Dir, Bin string
	// PKI is the cluster's CA.
	PKI *PKI
	// Kubeconfig is a kubeconfig file of a cluster admin (system:masters), for kubectl, helm or
	// an agent run in a namespace that reaches URL (see Attach).
	Kubeconfig string
	// Config and Client are the admin's, dialling through Netns: this process needs no route.
	Config *rest.Config
	Client kubernetes.Interface

	opts      Options
	run       *run
	etcd      *Process
	apiserver *Process
	attached  []string // namespaces Attach connected, by index
}

// StartControlPlane starts a control plane for the test and tears it down when the test ends,
// logging the components' logs if the test failed. It first removes what dead runs left (Reap). Outside CI, a machine without root, etcd or
// the Kubernetes binaries skips the test; in CI it fails.
func StartControlPlane(t testing.TB, opts Options) *ControlPlane {
	t.Helper()
	testutil.RequirePrivileged(t, "etcd", "nsenter", "ip")
	if _, err := Binaries(); err != nil {
		testutil.Unavailable(t, "%v", err)
	}
	reapT(t)
	cp, err := NewControlPlane(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			cp.logTails(t)
		}
		if err := cp.Close(); err != nil {
			t.Error(err)
		}
	})
	return cp
}

// NewControlPlane starts etcd and the API server and returns once the API server is ready.
// Close ends them and removes what they made.
func NewControlPlane(ctx context.Context, opts Options) (_ *ControlPlane, err error) {
	bin, err := Binaries()
	if err != nil {
		return nil, err
	}
	if len(opts.ServiceCIDRs) == 0 {
		opts.ServiceCIDRs = []netip.Prefix{DefaultServiceCIDR}
	}
	r, err := newRun()
	if err != nil {
		return nil, err
	}
	cp := &ControlPlane{Bin: bin, Dir: opts.Dir, opts: opts, run: r,
		URL: "https://" + net.JoinHostPort(APIAddress.String(), strconv.Itoa(APIPort))}
	if cp.Dir == "" {
		cp.Dir = r.dir
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, cp.Close())
		}
	}()
	for _, d := range []string{"pki", "etcd", "logs"} {
		if err := os.MkdirAll(filepath.Join(cp.Dir, d), 0o700); err != nil {
			return nil, err
		}
	}
	if cp.Netns, err = r.newNetns(ctx, "cp"); err != nil {
		return nil, err
	}
	if _, err := ip(ctx, "-n", cp.Netns, "addr", "add", APIAddress.String()+"/32", "dev", "lo"); err != nil {
		return nil, err
	}
	if err := cp.makePKI(); err != nil {
		return nil, err
	}
	if cp.Kubeconfig, err = cp.UserKubeconfig("admin", "system:masters"); err != nil {
		return nil, err
	}
	if cp.Config, err = cp.RESTConfig(cp.Kubeconfig); err != nil {
		return nil, err
	}
	if cp.Client, err = kubernetes.NewForConfig(cp.Config); err != nil {
		return nil, err
	}
	if err := cp.startEtcd(); err != nil {
		return nil, err
	}
	return cp, cp.StartAPIServer(ctx)
}

// makePKI issues the CA, the API server's serving certificate (every name a client may use for
// it, the "kubernetes" Service's ClusterIPs included), its client certificate to kubelets, and
// the service-account token signer.
func (cp *ControlPlane) makePKI() error {
	var err error
	if cp.PKI, err = NewPKI(filepath.Join(cp.Dir, "pki")); err != nil {
		return err
	}
	ips := []net.IP{APIAddress.AsSlice(), net.IPv4(127, 0, 0, 1)}
	for _, p := range cp.opts.ServiceCIDRs {
		ips = append(ips, p.Addr().Next().AsSlice())
	}
	if _, err := cp.PKI.Issue("apiserver", Cert{CommonName: "kube-apiserver", Server: true, IPs: ips,
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}}); err != nil {
		return err
	}
	if _, err := cp.PKI.Issue("apiserver-kubelet-client", Cert{CommonName: "kube-apiserver-kubelet-client", Groups: []string{"system:masters"}}); err != nil {
		return err
	}
	_, err = cp.PKI.KeyPair("sa")
	return err
}

func (cp *ControlPlane) ns() Namespaces { return Namespaces{Net: netnsPath(cp.Netns)} }

func (cp *ControlPlane) logPath(name string) string {
	return filepath.Join(cp.Dir, "logs", name+".log")
}

// startEtcd runs etcd on the namespace's loopback. fsync is off: the data lives as long as the
// test, and a loaded machine's disk would otherwise slow every write.
func (cp *ControlPlane) startEtcd() error {
	var err error
	cp.etcd, err = startProcess("etcd", cp.logPath("etcd"), cp.ns(), nil, "etcd",
		"--name=cp", "--data-dir="+filepath.Join(cp.Dir, "etcd"),
		"--listen-client-urls=http://127.0.0.1:2379", "--advertise-client-urls=http://127.0.0.1:2379",
		"--listen-peer-urls=http://127.0.0.1:2380", "--initial-advertise-peer-urls=http://127.0.0.1:2380",
		"--initial-cluster=cp=http://127.0.0.1:2380", "--unsafe-no-fsync", "--logger=zap", "--log-level=warn")
	return err
}

// StartAPIServer starts the API server (again, after StopAPIServer) and waits until it is ready.
func (cp *ControlPlane) StartAPIServer(ctx context.Context) error {
	if cp.apiserver != nil {
		if exited, _ := cp.apiserver.Exited(); !exited {
			return errors.New("the API server is running")
		}
	}
	pki := cp.PKI.Dir
	cidrs := make([]string, len(cp.opts.ServiceCIDRs))
	for i, p := range cp.opts.ServiceCIDRs {
		cidrs[i] = p.String()
	}
	var err error
	cp.apiserver, err = startProcess("kube-apiserver", cp.logPath("kube-apiserver"), cp.ns(), nil,
		filepath.Join(cp.Bin, "kube-apiserver"),
		"--etcd-servers=http://127.0.0.1:2379",
		"--bind-address=0.0.0.0", "--secure-port="+strconv.Itoa(APIPort), "--advertise-address="+APIAddress.String(),
		"--cert-dir="+filepath.Join(cp.Dir, "apiserver"),
		"--tls-cert-file="+filepath.Join(pki, "apiserver.crt"), "--tls-private-key-file="+filepath.Join(pki, "apiserver.key"),
		"--client-ca-file="+cp.PKI.CAFile,
		"--kubelet-client-certificate="+filepath.Join(pki, "apiserver-kubelet-client.crt"),
		"--kubelet-client-key="+filepath.Join(pki, "apiserver-kubelet-client.key"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+filepath.Join(pki, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(pki, "sa.key"),
		"--service-cluster-ip-range="+strings.Join(cidrs, ","),
		"--authorization-mode=Node,RBAC", "--allow-privileged=true", "--profiling=false",
		"--shutdown-watch-termination-grace-period=2s",
		// Logs, exec and port-forward reach the kubelet at the node's address: no DNS names it.
		"--kubelet-preferred-address-types=InternalIP")
	if err != nil {
		return err
	}
	return cp.waitReady(ctx)
}

// waitReady polls /readyz until the API server says it is ready.
func (cp *ControlPlane) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	var last error
	for {
		if err := cp.apiserver.alive(); err != nil {
			return err
		}
		if err := cp.etcd.alive(); err != nil {
			return err
		}
		body, err := cp.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err == nil && string(body) == "ok" {
			return nil
		}
		last = fmt.Errorf("%w: %s", err, body)
		select {
		case <-ctx.Done():
			return fmt.Errorf("the API server is not ready after %v: %w", readyTimeout, last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// StopAPIServer stops the API server (SIGTERM, as a rolling control-plane upgrade does); etcd
// keeps every object for the next StartAPIServer.
func (cp *ControlPlane) StopAPIServer() error {
	if cp.apiserver == nil {
		return nil
	}
	return cp.apiserver.Stop(20 * time.Second)
}

// RestartAPIServer stops the API server and starts it again, waiting until it is ready.
func (cp *ControlPlane) RestartAPIServer(ctx context.Context) error {
	if err := cp.StopAPIServer(); err != nil {
		return err
	}
	return cp.StartAPIServer(ctx)
}

// UserKubeconfig writes a kubeconfig of a user authenticated by a client certificate with the
// given name and groups (no group but system:authenticated gives it no permission: RBAC tests
// bind what they need), and returns its path.
func (cp *ControlPlane) UserKubeconfig(user string, groups ...string) (string, error) {
	name := "user-" + user
	pair, err := cp.PKI.Issue(name, Cert{CommonName: user, Groups: groups})
	if err != nil {
		return "", err
	}
	path := filepath.Join(cp.Dir, name+".kubeconfig")
	return path, writeKubeconfig(path, cp.URL, cp.PKI.CAFile, user, pair)
}

// writeKubeconfig writes a kubeconfig with the certificates' data inline, so it works wherever
// it is read from (a pod's mount, another mount namespace).
func writeKubeconfig(path, server, caFile, user string, pair Pair) error {
	ca, err := os.ReadFile(caFile)
	if err != nil {
		return err
	}
	cert, err := os.ReadFile(pair.CertFile)
	if err != nil {
		return err
	}
	key, err := os.ReadFile(pair.KeyFile)
	if err != nil {
		return err
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{ClientCertificateData: cert, ClientKeyData: key}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: user}
	cfg.CurrentContext = "test"
	return clientcmd.WriteToFile(*cfg, path)
}

// RESTConfig is the client configuration of a kubeconfig, dialling through the control plane's
// namespace, for clients in this process.
func (cp *ControlPlane) RESTConfig(kubeconfig string) (*rest.Config, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, err
	}
	cfg.Dial = dialIn(cp.Netns)
	cfg.QPS, cfg.Burst = 100, 200
	return cfg, nil
}

// Kubectl runs kubectl as the admin inside the control plane's namespace and returns its
// standard output and error.
func (cp *ControlPlane) Kubectl(ctx context.Context, args ...string) (string, error) {
	return cp.ns().Run(ctx, 2*time.Minute, append([]string{filepath.Join(cp.Bin, "kubectl"), "--kubeconfig=" + cp.Kubeconfig}, args...)...)
}

// Attach connects the network namespace ns to the control plane by a veth pair and routes
// APIAddress from ns through it, so that processes in ns (agents, a kubelet) reach URL; routes
// are the prefixes in ns, such as a pod range, that the control plane routes back through the
// pair. It returns ns's address on the pair, the source of its requests.
func (cp *ControlPlane) Attach(ctx context.Context, ns string, routes ...netip.Prefix) (netip.Addr, error) {
	n := len(cp.attached)
	if n > 255 {
		return netip.Addr{}, errors.New("attach: no more than 256 namespaces")
	}
	base := attachNet.Addr().As4()
	base[2] = byte(n)
	l := Link{NsA: cp.Netns, NameA: fmt.Sprintf("att%d", n), NsB: ns, NameB: "kapi",
		Net: netip.PrefixFrom(netip.AddrFrom4(base), 30)}
	if err := l.create(ctx); err != nil {
		return netip.Addr{}, fmt.Errorf("attach %s: %w", ns, err)
	}
	cp.attached = append(cp.attached, ns)
	if err := route(ctx, ns, netip.PrefixFrom(APIAddress, 32), l.AddrA()); err != nil {
		return netip.Addr{}, err
	}
	for _, r := range routes {
		if err := route(ctx, cp.Netns, r, l.AddrB()); err != nil {
			return netip.Addr{}, err
		}
	}
	return l.AddrB(), nil
}

// AttachT is Attach for a test: it fails the test on an error.
func (cp *ControlPlane) AttachT(t testing.TB, ns string, routes ...netip.Prefix) netip.Addr {
	t.Helper()
	addr, err := cp.Attach(context.Background(), ns, routes...)
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

// Close stops the API server and etcd, deletes the namespace (and with it every Attach pair)
// and removes the run directory (the state directory, unless Options named one). After a
// failed teardown the run directory stays, for a later run's Reap.
func (cp *ControlPlane) Close() error {
	err := cp.teardown()
	return errors.Join(err, cp.run.end(err == nil))
}

// teardown stops the components and deletes the namespace.
func (cp *ControlPlane) teardown() error {
	var errs []error
	for _, p := range []*Process{cp.apiserver, cp.etcd} {
		if p != nil {
			errs = append(errs, p.Stop(10*time.Second))
		}
	}
	if cp.Netns != "" {
		errs = append(errs, testutil.DeleteNetns(context.Background(), cp.Netns))
	}
	return errors.Join(errs...)
}

// logTails logs the end of each component's log.
func (cp *ControlPlane) logTails(t testing.TB) {
	for _, p := range []*Process{cp.etcd, cp.apiserver} {
		if p != nil {
			t.Logf("%s log (%s) ends:\n%s", p.Name, p.Log, p.Tail(40))
		}
	}
}
