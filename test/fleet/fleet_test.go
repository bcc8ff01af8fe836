package fleet

import (
	"context"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// liveness bounds each wait: a watch event reaches an agent in milliseconds, an agent's status
// is written within statusDelay; the bound is for a machine under load.
const liveness = 60 * time.Second

// statusDelay is the agents' --node-status-delay here: short, so that the test waits little for
// the statuses; the writes stay spread and rate-limited by it as in a fleet.
const statusDelay = 500 * time.Millisecond

// probeDst is the destination whose verdict the configurations flip: masqueraded, or kept
// when a configuration lists it among nonMasqueradeCIDRs.
var probeDst = netip.MustParseAddr("8.8.8.8")

// The configurations the tests write.
const (
	configMasq = "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16]\n"
	configKeep = "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 8.8.8.8/32]\n"
	// configBad is one the agent rejects and the admission policy leaves to it.
	configBad = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqOutBound: maybe\n"
)

// node is one node of a fleet: its topology (pod, node, external host), routed to the API
// server, and its agent.
type node struct {
	name       string
	env        *e2e.Env
	agent      *e2e.Agent
	kubeconfig string
}

// fleet is a control plane of its own and the nodes whose agents read their configuration from
// it, with the permissions deploy/rbac grants and a pod's token each (so that the admission
// policy of rbac/status keeps each to its own node's status).
type fleet struct {
	cp    *cluster.ControlPlane
	b     e2e.Backend
	nodes []*node
}

// newFleet starts a control plane, installs the CRDs, the RBAC of deploy/rbac (status, both
// sources and the pods of source rules) and the node-status policy, and readies n nodes for
// backend b. The agents start with start.
func newFleet(ctx context.Context, t *testing.T, b e2e.Backend, n int) *fleet {
	t.Helper()
	testutil.RequirePrivileged(t, append([]string{"ip"}, b.Tools...)...)
	if agentBin == "" {
		t.Fatal("no agent binary was built")
	}
	f := &fleet{cp: cluster.StartControlPlane(t, cluster.Options{}), b: b}
	applyCRDs(ctx, t, f.cp)
	for _, path := range []string{"rbac/status/serviceaccount.yaml", "rbac/status/clusterrole.yaml", "rbac/status/nodestatus.yaml",
		"rbac/configmap/role.yaml", "rbac/crd/clusterrole.yaml", "rbac/pods/clusterrole.yaml"} {
		kubectl(ctx, t, f.cp, "apply", "-f", deployPath(t, path))
	}
	for i := range n {
		f.nodes = append(f.nodes, f.newNode(ctx, t, fmt.Sprintf("node-%d", i)))
	}
	return f
}

// newNode makes a node: its Node object, an agent pod bound to it (never run: there is no
// kubelet, only its service account token is wanted), the token's kubeconfig, and the topology.
func (f *fleet) newNode(ctx context.Context, t *testing.T, name string) *node {
	t.Helper()
	core := f.cp.Client.CoreV1()
	if _, err := core.Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := "ip-masq-agent-" + name
	if _, err := core.Pods("kube-system").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: pod},
		Spec: corev1.PodSpec{NodeName: name, ServiceAccountName: "ip-masq-agent",
			Containers: []corev1.Container{{Name: "ip-masq-agent", Image: "ip-masq-agent"}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	token := strings.TrimSpace(kubectl(ctx, t, f.cp, "create", "token", "ip-masq-agent", "-n", "kube-system",
		"--bound-object-kind=Pod", "--bound-object-name="+pod, "--duration=1h"))
	n := &node{name: name, kubeconfig: tokenKubeconfig(t, f.cp, token)}
	n.env = e2e.NewEnv(ctx, t, agentBin, []string{})
	if f.b.Prepare != nil {
		f.b.Prepare(ctx, t, n.env)
	}
	f.cp.AttachT(t, n.env.Node)
	return n
}

// tokenKubeconfig writes a kubeconfig of the API server with the token, as a pod's service
// account mount gives it.
func tokenKubeconfig(t *testing.T, cp *cluster.ControlPlane, token string) string {
	t.Helper()
	ca, err := os.ReadFile(cp.PKI.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["test"] = &clientcmdapi.Cluster{Server: cp.URL, CertificateAuthorityData: ca}
	cfg.AuthInfos["agent"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["test"] = &clientcmdapi.Context{Cluster: "test", AuthInfo: "agent"}
	cfg.CurrentContext = "test"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// start runs every node's agent with the source (a --config-source value) and waits until
// each is ready.
func (f *fleet) start(ctx context.Context, t *testing.T, source string) {
	t.Helper()
	for _, n := range f.nodes {
		n.agent = f.startAgent(ctx, t, n, source, n.kubeconfig)
		if err := n.agent.WaitReady(ctx); err != nil {
			t.Fatalf("%s: %v", n.name, err)
		}
	}
}

func (f *fleet) startAgent(ctx context.Context, t *testing.T, n *node, source, kubeconfig string) *e2e.Agent {
	t.Helper()
	env := n.env
	flags := env.AgentFlags
	env.AgentFlags = append(append([]string{}, flags...), "--config-source="+source, "--kubeconfig="+kubeconfig,
		"--node-status", "--node-name="+n.name, fmt.Sprintf("--node-status-delay=%v", statusDelay))
	defer func() { env.AgentFlags = flags }()
	return env.StartAgent(ctx, t, f.b)
}

// stop ends every node's agent.
func (f *fleet) stop(ctx context.Context, t *testing.T) {
	t.Helper()
	for _, n := range f.nodes {
		if err := n.agent.Stop(ctx); err != nil {
			t.Errorf("%s: agent exit: %v", n.name, err)
		}
	}
}

// verdict is what the external host sees of the pod's traffic to probeDst from node n.
func verdict(ctx context.Context, n *node) (e2e.Want, error) {
	w, _, err := n.env.Observe(ctx, "udp", probeDst)
	return w, err
}

// rollout writes a change (write) that flips probeDst's verdict to want, and measures, for
// every node, the time from the API write to the changed verdict in its datapath (probed), and
// to its agent's apply (its log). It returns the slowest.
func (f *fleet) rollout(ctx context.Context, t *testing.T, what string, want e2e.Want, write func()) time.Duration {
	t.Helper()
	for _, n := range f.nodes {
		if w, err := verdict(ctx, n); err != nil || w == want {
			t.Fatalf("%s: %s before the change: %v, %v", what, n.name, w, err)
		}
	}
	applied := make([]int, len(f.nodes))
	for i, n := range f.nodes {
		applied[i] = n.agent.Count("policy applied")
	}
	start := time.Now()
	write()
	took := make([]time.Duration, len(f.nodes))
	var wg sync.WaitGroup
	for i, n := range f.nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = testutil.Poll(time.Until(start.Add(liveness)), 2*time.Millisecond, func() error {
				if w, err := verdict(ctx, n); err != nil || w != want {
					return testutil.NotYet("%s, %v", w, err)
				}
				took[i] = time.Since(start)
				return nil
			}) // a verdict that did not change leaves took[i] zero, reported below
		}()
	}
	wg.Wait()
	var slowest time.Duration
	for i, n := range f.nodes {
		if took[i] == 0 {
			t.Errorf("%s: %s's verdict did not change within %v", what, n.name, liveness)
			continue
		}
		agentPart := "?"
		err := n.agent.WaitLog(ctx, applied[i]+1, "policy applied") // logged a hair after the apply
		at, err2 := n.agent.LogTime(applied[i]+1, "policy applied")
		if err == nil && err2 == nil {
			agentPart = at.Sub(start).Round(time.Millisecond).String()
		}
		t.Logf("%s, %s: API write to the changed verdict in the datapath %v (the agent's apply done at %s)",
			what, n.name, took[i].Round(time.Millisecond), agentPart)
		slowest = max(slowest, took[i])
	}
	t.Logf("%s: the slowest of %d agents %v", what, len(f.nodes), slowest.Round(time.Millisecond))
	return slowest
}

// eachBackend runs body for every backend, in parallel, each with a fleet of its own.
func eachBackend(t *testing.T, body func(ctx context.Context, t *testing.T, b e2e.Backend)) {
	for _, b := range e2e.Backends() {
		t.Run(b.Name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
			defer cancel()
			body(ctx, t, b)
		})
	}
}

// statuses are the fleet's IPMasqAgentNodes by node.
func (f *fleet) statuses(ctx context.Context, t *testing.T) map[string]*unstructured.Unstructured {
	t.Helper()
	list, err := dynamic.NewForConfigOrDie(f.cp.Config).Resource(kube.Nodes.GVR()).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*unstructured.Unstructured{}
	for i := range list.Items {
		out[list.Items[i].GetName()] = &list.Items[i]
	}
	return out
}

// waitStatus waits until every node's status has the state and the configuration's hash.
func (f *fleet) waitStatus(ctx context.Context, t *testing.T, state, hash string) map[string]*unstructured.Unstructured {
	t.Helper()
	var st map[string]*unstructured.Unstructured
	eventually(t, "every status "+state, liveness, func() bool {
		st = f.statuses(ctx, t)
		for _, n := range f.nodes {
			o, ok := st[n.name]
			if !ok || field(o, "status", "state") != state || field(o, "status", "config", "hash") != hash {
				return false
			}
		}
		return true
	})
	return st
}

func field(o *unstructured.Unstructured, path ...string) string {
	s, _, _ := unstructured.NestedString(o.Object, path...)
	return s
}

// hashOf is the status's hash of a configuration document.
func hashOf(t *testing.T, doc string) string {
	t.Helper()
	cfg, err := config.Parse([]byte(doc), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return agent.ConfigHash(cfg)[:kube.HashLength]
}

// ready tells whether the agent's /readyz answers 200.
func ready(ctx context.Context, n *node) bool {
	code, _, err := n.agent.Get(ctx, "/readyz")
	return err == nil && code == http.StatusOK
}
