package fleet

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/yaml"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// steadyWindow is how long the steady state's writes are counted.
const steadyWindow = 30 * time.Second

// TestRollout, on every backend, three agents reading their configuration from a real API
// server: a ConfigMap edit reaches every datapath (the time from the API write to the changed
// verdict is printed); kubectl get ipmasqagentnodes shows each agent's hash and state after a
// good and a bad configuration; in steady state the agents write nothing (counted by the API
// server's resourceVersions and the agents' own metric); an agent cannot write another node's
// status; the API server stopped and started under the agents loses nothing; and the same
// rollout from an IPMasqAgentConfig.
func TestRollout(t *testing.T) {
	eachBackend(t, func(ctx context.Context, t *testing.T, b e2e.Backend) {
		f := newFleet(ctx, t, b, 3)
		cms := f.cp.Client.CoreV1().ConfigMaps("kube-system")
		cm, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: kube.DefaultConfigMapName},
			Data: map[string]string{kube.ConfigMapKey: configMasq}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		f.start(ctx, t, "configmap")
		f.waitStatus(ctx, t, kube.StateReady, hashOf(t, configMasq))
		setConfig := func(doc string) {
			cm.Data[kube.ConfigMapKey] = doc
			if cm, err = cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		f.rollout(ctx, t, "ConfigMap edit", e2e.Keep, func() { setConfig(configKeep) })
		f.waitStatus(ctx, t, kube.StateReady, hashOf(t, configKeep))
		table := kubectl(ctx, t, f.cp, "get", kube.Nodes.Plural)
		t.Logf("after a good configuration:\n%s", table)
		checkTable(t, f, table, hashOf(t, configKeep), kube.StateReady)

		// A bad configuration: each agent keeps the good one, and says so.
		setConfig(configBad)
		st := f.waitStatus(ctx, t, kube.StateDegraded, hashOf(t, configKeep))
		for _, n := range f.nodes {
			if r := field(st[n.name], "status", "rejected", "reason"); !strings.Contains(r, `masqOutBound: "maybe": must be true or false`) ||
				field(st[n.name], "status", "rejected", "resourceVersion") != cm.ResourceVersion {
				t.Errorf("%s: rejected %q (revision %s), want the bad one's", n.name, r, field(st[n.name], "status", "rejected", "resourceVersion"))
			}
			if w, err := verdict(ctx, n); err != nil || w != e2e.Keep {
				t.Errorf("%s: after the bad configuration %v, %v; want the good one's verdict", n.name, w, err)
			}
		}
		table = kubectl(ctx, t, f.cp, "get", kube.Nodes.Plural, "-o", "wide")
		t.Logf("after a bad configuration:\n%s", table)
		checkTable(t, f, table, hashOf(t, configKeep), kube.StateDegraded)
		countSteadyWrites(ctx, t, f)
		ownNodeOnly(ctx, t, f)

		// The API server goes away under the agents and comes back: nothing changes meanwhile.
		setConfig(configKeep)
		f.waitStatus(ctx, t, kube.StateReady, hashOf(t, configKeep))
		apiServerRestart(ctx, t, f)
		f.rollout(ctx, t, "ConfigMap edit after the API server's restart", e2e.Masq, func() { setConfig(configMasq) })
		// A stopped agent's status stays as it wrote it last: let them write this one, so that
		// the next one seen is the next agents'.
		f.waitStatus(ctx, t, kube.StateReady, hashOf(t, configMasq))

		// The same from an IPMasqAgentConfig.
		f.stop(ctx, t)
		crs := dynamic.NewForConfigOrDie(f.cp.Config).Resource(kube.Configs.GVR())
		if _, err := crs.Create(ctx, ipMasqAgentConfig(kube.DefaultConfigName, spec(t, configMasq)), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		f.start(ctx, t, "crd")
		f.rollout(ctx, t, "IPMasqAgentConfig edit", e2e.Keep, func() {
			patch, _ := json.Marshal(map[string]any{"spec": spec(t, configKeep)})
			if _, err := crs.Patch(ctx, kube.DefaultConfigName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
				t.Fatal(err)
			}
		})
		st = f.waitStatus(ctx, t, kube.StateReady, hashOf(t, configKeep))
		for _, n := range f.nodes {
			if g, _, _ := unstructured.NestedInt64(st[n.name].Object, "status", "config", "generation"); g != 2 {
				t.Errorf("%s: generation %d in force, want 2", n.name, g)
			}
		}
	})
}

// spec is a configuration document as an IPMasqAgentConfig's spec.
func spec(t *testing.T, doc string) map[string]any {
	t.Helper()
	var s map[string]any
	if err := yaml.Unmarshal([]byte(doc), &s); err != nil {
		t.Fatal(err)
	}
	return s
}

// checkTable checks kubectl get's table: a row per node with the hash and the state.
func checkTable(t *testing.T, f *fleet, table, hash, state string) {
	t.Helper()
	for _, n := range f.nodes {
		found := false
		for _, line := range strings.Split(table, "\n") {
			cols := strings.Fields(line)
			if len(cols) > 0 && cols[0] == n.name {
				found = strings.Contains(line, hash) && strings.Contains(line, state) && strings.Contains(line, f.b.Info.Backend)
			}
		}
		if !found {
			t.Errorf("kubectl get shows no row %s with %s, %s and %s:\n%s", n.name, hash, f.b.Info.Backend, state, table)
		}
	}
}

// countSteadyWrites counts the status writes of steadyWindow in which nothing changes: by the
// objects' resourceVersions (the API server's count) and the agents' metric.
func countSteadyWrites(ctx context.Context, t *testing.T, f *fleet) {
	t.Helper()
	before := f.statuses(ctx, t)
	writes := func() float64 {
		var sum float64
		for _, n := range f.nodes {
			m, err := n.agent.Scrape(ctx)
			if err != nil {
				t.Fatal(err)
			}
			v, _ := m.Value("ip_masq_agent_node_status_writes_total", e2e.Labels{"result": "success"})
			sum += v
		}
		return sum
	}
	w0 := writes()
	time.Sleep(steadyWindow)
	after := f.statuses(ctx, t)
	changed := 0
	for name, o := range before {
		if after[name].GetResourceVersion() != o.GetResourceVersion() {
			changed++
		}
	}
	w := writes() - w0
	perMinute := w / float64(len(f.nodes)) / steadyWindow.Minutes()
	size, _ := json.Marshal(before[f.nodes[0].name].Object)
	t.Logf("steady state, %v: %d objects rewritten, %v writes by %d agents: %.1f writes per agent per minute; an object is %d bytes",
		steadyWindow, changed, w, len(f.nodes), perMinute, len(size))
	if changed != 0 || w != 0 {
		t.Errorf("the agents wrote %v times (%d objects changed) in steady state", w, changed)
	}
}

// ownNodeOnly: an agent's token cannot write another node's status (rbac/status/nodestatus.yaml).
func ownNodeOnly(ctx context.Context, t *testing.T, f *fleet) {
	t.Helper()
	cfg, err := f.cp.RESTConfig(f.nodes[0].kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	res := dynamic.NewForConfigOrDie(cfg).Resource(kube.Nodes.GVR())
	obj := map[string]any{"apiVersion": kube.Nodes.APIVersion(), "kind": kube.Nodes.Kind,
		"metadata": map[string]any{"name": f.nodes[1].name}, "status": map[string]any{"state": kube.StateNotReady}}
	data, _ := json.Marshal(obj)
	force := true
	for _, sub := range [][]string{nil, {"status"}} { // the object, and its status subresource, where the agent writes
		_, err = res.Patch(ctx, f.nodes[1].name, types.ApplyPatchType, data, metav1.PatchOptions{FieldManager: "ip-masq-agent", Force: &force}, sub...)
		if err == nil || !strings.Contains(err.Error(), "an agent writes only its own node's IPMasqAgentNode: this one runs on node-0") {
			t.Errorf("node-0's agent writing node-1's status (subresource %q): %v", sub, err)
		}
	}
}

// apiServerRestart stops the API server under the agents: each keeps its datapath and its
// readiness and says it lost the API server; then starts it again: each says it is back.
func apiServerRestart(ctx context.Context, t *testing.T, f *fleet) {
	t.Helper()
	reachable := func(n *node) float64 {
		m, err := n.agent.Scrape(ctx)
		if err != nil {
			t.Fatal(err)
		}
		v, _ := m.Value("ip_masq_agent_config_source_reachable", e2e.Labels{})
		return v
	}
	if err := f.cp.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	for _, n := range f.nodes {
		if err := n.agent.WaitLog(ctx, 1, "cannot read the configuration from the API server; the configuration in force stays"); err != nil {
			t.Fatal(err)
		}
		eventually(t, n.name+" unreachable", liveness, func() bool { return reachable(n) == 0 })
		if w, err := verdict(ctx, n); err != nil || w != e2e.Keep || !ready(ctx, n) {
			t.Errorf("%s without the API server: %v, %v, ready %v; want the configuration in force, ready", n.name, w, err, ready(ctx, n))
		}
	}
	if err := f.cp.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	for _, n := range f.nodes {
		if err := n.agent.WaitLog(ctx, 1, "the API server answers again"); err != nil {
			t.Fatal(err)
		}
		eventually(t, n.name+" reachable", liveness, func() bool { return reachable(n) == 1 })
	}
}

// TestWithoutPermission: an agent whose credentials have no RBAC binding says which permission
// it lacks, for reading its configuration and for writing its status, and is not ready.
func TestWithoutPermission(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	b := e2e.Backends()[0]
	f := newFleet(ctx, t, b, 1)
	nobody, err := f.cp.UserKubeconfig("nobody")
	if err != nil {
		t.Fatal(err)
	}
	n := f.nodes[0]
	n.agent = f.startAgent(ctx, t, n, "configmap", nobody)
	for _, want := range [][]string{
		{"cannot read the configuration from the API server", `need="get, list and watch on configmaps \"ip-masq-agent\" in the namespace kube-system"`},
		{"cannot write the node's status", `need="create and patch on ipmasqagentnodes.ip-masq-agent.github.io"`},
	} {
		if err := n.agent.WaitLog(ctx, 1, want...); err != nil {
			t.Fatal(err)
		}
	}
	code, body, err := n.agent.Get(ctx, "/readyz")
	if err != nil || code != 503 || !strings.Contains(body, `needs get, list and watch on configmaps "ip-masq-agent"`) {
		t.Errorf("readyz %d %q, %v; want 503 naming the permission", code, body, err)
	}
}
