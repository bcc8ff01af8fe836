package nodestatus_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/apisource"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nodestatus"
)

// wait bounds each wait for a write: the publisher writes within its delay (here 200ms).
const wait = 30 * time.Second

// stats is an agent whose Stats the test sets.
type stats struct {
	mu sync.Mutex
	s  agent.Stats
}

func (s *stats) Stats() agent.Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.s
}

func (s *stats) set(f func(*agent.Stats)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(&s.s)
}

// publish runs a publisher of the agent st's state until the test ends; edits change its options.
func publish(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, kubeconfig, node string, st interface{ Stats() agent.Stats },
	edits ...func(*nodestatus.Options)) (*nodestatus.Publisher, *testutil.Buffer) {
	t.Helper()
	cfg, err := cp.RESTConfig(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testutil.Buffer{}
	opts := nodestatus.Options{Node: node, Agent: st, Backend: &datapathtest.Backend{},
		Source: "configmap kube-system/ip-masq-agent", Reason: "--backend=fake", Delay: 200 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(logs, nil))}
	for _, edit := range edits {
		edit(&opts)
	}
	p, err := nodestatus.New(cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		if t.Failed() {
			t.Logf("publisher log:\n%s", logs)
		}
	})
	return p, logs
}

// statusOf polls the node's IPMasqAgentNode until cond holds of it.
func statusOf(ctx context.Context, t *testing.T, res dynamic.ResourceInterface, node, what string, cond func(*unstructured.Unstructured) bool) *unstructured.Unstructured {
	t.Helper()
	var o *unstructured.Unstructured
	if err := testutil.Poll(wait, 50*time.Millisecond, func() error {
		var err error
		if o, err = res.Get(ctx, node, metav1.GetOptions{}); err != nil || !cond(o) {
			return testutil.NotYet("%s (%v)", what, err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return o
}

// node creates the Node name.
func node(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, name string) {
	t.Helper()
	if _, err := cp.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// statusSubresource says whether the agent's fields of o were written through its status
// subresource.
func statusSubresource(o *unstructured.Unstructured) bool {
	for _, m := range o.GetManagedFields() {
		if m.Manager == nodestatus.FieldManager && m.Subresource == "status" {
			return true
		}
	}
	return false
}

// configObject: the status of an agent that reads an IPMasqAgentConfig, through the real
// source and agent. An edit of the object's labels and annotations (its generation unchanged)
// writes no status; its deletion keeps the configuration in force and says so
// (ConfigObjectPresent false, ConfigObjectDeleted); an empty spec brings the defaults.
func configObject(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, res dynamic.ResourceInterface) {
	node(ctx, t, cp, "node-c")
	configs := dynamic.NewForConfigOrDie(cp.Config).Resource(kube.Configs.GVR())
	obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": kube.Configs.APIVersion(), "kind": kube.Configs.Kind,
		"metadata": map[string]any{"name": kube.DefaultConfigName}, "spec": map[string]any{"nonMasqueradeCIDRs": []any{"10.0.0.0/8"}}}}
	if _, err := configs.Create(ctx, obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	src, err := apisource.New(cp.Config, apisource.Object{Kind: apisource.KindConfig, Name: kube.DefaultConfigName}, apisource.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a, err := agent.New(agent.Options{Source: src, Backend: &datapathtest.Backend{}})
	if err != nil {
		t.Fatal(err)
	}
	actx, stop := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- a.Run(actx, nil) }()
	t.Cleanup(func() {
		stop()
		if err := <-stopped; err != nil {
			t.Errorf("agent: %v", err)
		}
	})
	p, _ := publish(ctx, t, cp, cp.Kubeconfig, "node-c", a, func(o *nodestatus.Options) {
		o.Source, o.Deleted = src.String(), src
	})
	o := statusOf(ctx, t, res, "node-c", "the configuration in force", func(o *unstructured.Unstructured) bool {
		return field(o, "status", "state") == kube.StateReady && field(o, "status", "config", "hash") != ""
	})
	hash := field(o, "status", "config", "hash")
	if c := conditionOf(o, kube.ConditionConfigObjectPresent); c["status"] != "True" {
		t.Errorf("%s: %v", kube.ConditionConfigObjectPresent, c)
	}

	// Labels and annotations: no status write.
	time.Sleep(3 * time.Second) // any write still due is done
	o = statusOf(ctx, t, res, "node-c", "the status before the edit", func(*unstructured.Unstructured) bool { return true })
	writes, _ := p.Writes()
	cfgObj, err := configs.Get(ctx, kube.DefaultConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfgObj.SetLabels(map[string]string{"team": "net"})
	cfgObj.SetAnnotations(map[string]string{"note": "metadata only"})
	edited, err := configs.Update(ctx, cfgObj, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if edited.GetGeneration() != cfgObj.GetGeneration() || edited.GetResourceVersion() == cfgObj.GetResourceVersion() {
		t.Fatalf("the edit: generation %d -> %d, resourceVersion %s -> %s", cfgObj.GetGeneration(), edited.GetGeneration(),
			cfgObj.GetResourceVersion(), edited.GetResourceVersion())
	}
	time.Sleep(3 * time.Second) // the publisher polls every second and writes within 200ms
	after := statusOf(ctx, t, res, "node-c", "the status after the edit", func(*unstructured.Unstructured) bool { return true })
	if w, _ := p.Writes(); w != writes || after.GetResourceVersion() != o.GetResourceVersion() {
		t.Errorf("a metadata-only edit: %d status writes (before: %d), resourceVersion %s (before: %s); want none",
			w, writes, after.GetResourceVersion(), o.GetResourceVersion())
	}

	// The deletion: the configuration in force stays, and the status says so.
	if err := configs.Delete(ctx, kube.DefaultConfigName, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	o = statusOf(ctx, t, res, "node-c", "the deletion told", func(o *unstructured.Unstructured) bool {
		return conditionOf(o, kube.ConditionConfigObjectPresent)["status"] == "False"
	})
	if c := conditionOf(o, kube.ConditionConfigObjectPresent); c["reason"] != kube.ReasonConfigObjectDeleted || field(o, "status", "config", "hash") != hash ||
		field(o, "status", "state") != kube.StateDegraded || !strings.Contains(field(o, "status", "message"), "was deleted") {
		t.Errorf("after the deletion: %v; want the configuration %s still in force, Degraded, %s", o.Object["status"], hash, kube.ReasonConfigObjectDeleted)
	}

	// An empty spec: the defaults, on purpose.
	obj.SetResourceVersion("")
	obj.Object["spec"] = map[string]any{}
	if _, err := configs.Create(ctx, obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	want := agent.ConfigHash(config.Default(config.Options{}))[:kube.HashLength]
	o = statusOf(ctx, t, res, "node-c", "the defaults", func(o *unstructured.Unstructured) bool {
		return field(o, "status", "config", "hash") == want
	})
	if c := conditionOf(o, kube.ConditionConfigObjectPresent); c["status"] != "True" || field(o, "status", "state") != kube.StateReady {
		t.Errorf("with an empty spec: %v", o.Object["status"])
	}
}

// conditionOf is o's status condition typ, nil when it has none.
func conditionOf(o *unstructured.Unstructured, typ string) map[string]any {
	cs, _, _ := unstructured.NestedSlice(o.Object, "status", "conditions")
	for _, c := range cs {
		if m, ok := c.(map[string]any); ok && m["type"] == typ {
			return m
		}
	}
	return nil
}

func field(o *unstructured.Unstructured, path ...string) string {
	s, _, _ := unstructured.NestedString(o.Object, path...)
	return s
}

// The publisher against a real API server: the first write creates the node's object, owned by
// its Node; a state that does not change writes nothing until its heartbeat; a change is written
// within the delay; the status goes through the status subresource; an edit of the
// configuration's object that leaves the configuration as it was writes nothing, its deletion is
// told; without permission it says which it needs.
func TestPublish(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cp := cluster.StartControlPlane(t, cluster.Options{})
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	crds := filepath.Join(root, "deploy", "crds")
	if out, err := cp.Kubectl(ctx, "apply", "-f", filepath.Join(crds, "ipmasqagentnodes.yaml"), "-f", filepath.Join(crds, "ipmasqagentconfigs.yaml")); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if out, err := cp.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s", "crd/"+kube.Nodes.CRDName(), "crd/"+kube.Configs.CRDName()); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	n, err := cp.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	res := dynamic.NewForConfigOrDie(cp.Config).Resource(kube.Nodes.GVR())

	st := &stats{s: agent.Stats{Ready: true, ConfigSHA256: strings.Repeat("0123456789abcdef", 4)}}
	p, logs := publish(ctx, t, cp, cp.Kubeconfig, "node-a", st)
	// The object is created first, and its status written through the subresource after: the
	// first write is done when the status is there.
	o := statusOf(ctx, t, res, "node-a", "the first write", func(o *unstructured.Unstructured) bool {
		return field(o, "status", "state") != ""
	})
	if field(o, "status", "state") != kube.StateReady || field(o, "status", "config", "hash") != "0123456789abcdef" ||
		field(o, "status", "backend", "name") != datapathtest.Name {
		t.Errorf("status %v", o.Object["status"])
	}
	if refs := o.GetOwnerReferences(); len(refs) != 1 || refs[0].Kind != "Node" || refs[0].UID != n.UID {
		t.Errorf("owners %+v, want the Node %s", refs, n.UID)
	}
	// Nothing changes: nothing is written.
	rv := o.GetResourceVersion()
	time.Sleep(2 * time.Second)
	if o, _ := res.Get(ctx, "node-a", metav1.GetOptions{}); o.GetResourceVersion() != rv {
		t.Errorf("written again without a change: resourceVersion %s, then %s", rv, o.GetResourceVersion())
	}
	if ok, failed := p.Writes(); ok != 1 || failed != 0 {
		t.Errorf("writes %d, failed %d; want 1 and 0", ok, failed)
	}
	// A rejected configuration: Degraded, with why.
	st.set(func(s *agent.Stats) {
		s.Rejected = `configmap kube-system/ip-masq-agent: masqOutBound: "maybe": must be true or false`
	})
	o = statusOf(ctx, t, res, "node-a", "the rejection", func(o *unstructured.Unstructured) bool {
		return field(o, "status", "state") == kube.StateDegraded
	})
	if !strings.Contains(field(o, "status", "rejected", "reason"), `masqOutBound: "maybe"`) || !strings.Contains(field(o, "status", "message"), "maybe") {
		t.Errorf("status %v", o.Object["status"])
	}
	// The server holds the write before the publisher has counted it.
	_ = testutil.Poll(wait, 20*time.Millisecond, func() error {
		if ok, _ := p.Writes(); ok < 2 {
			return testutil.NotYet("%d writes", ok)
		}
		return nil
	})
	if ok, _ := p.Writes(); ok != 2 {
		t.Errorf("%d writes for two states", ok)
	}
	if !statusSubresource(o) {
		t.Errorf("the status was not written through the status subresource: %+v", o.GetManagedFields())
	}
	if strings.Contains(logs.String(), "replaced the node's status") {
		t.Errorf("a new object's status replaced:\n%s", logs)
	}

	t.Run("heartbeat", func(t *testing.T) {
		node(ctx, t, cp, "node-b")
		p, _ := publish(ctx, t, cp, cp.Kubeconfig, "node-b", &stats{s: agent.Stats{Ready: true}}, func(o *nodestatus.Options) {
			o.Heartbeat = 1500 * time.Millisecond
		})
		first := statusOf(ctx, t, res, "node-b", "the first write", func(o *unstructured.Unstructured) bool {
			return field(o, "status", "lastHeartbeatTime") != ""
		})
		beat := field(first, "status", "lastHeartbeatTime")
		// Nothing changes, and the status is written again: only its heartbeat moves.
		next := statusOf(ctx, t, res, "node-b", "a heartbeat", func(o *unstructured.Unstructured) bool {
			return field(o, "status", "lastHeartbeatTime") > beat
		})
		if next.GetResourceVersion() == first.GetResourceVersion() || field(next, "status", "state") != kube.StateReady {
			t.Errorf("after a heartbeat: resourceVersion %s (was %s), state %s", next.GetResourceVersion(), first.GetResourceVersion(), field(next, "status", "state"))
		}
		last, every := p.Heartbeat()
		if every != 1500*time.Millisecond || last.UTC().Format(time.RFC3339) < beat {
			t.Errorf("Heartbeat() = %v, %v; the object's last is after %s", last, every, beat)
		}
	})

	t.Run("config object", func(t *testing.T) { configObject(ctx, t, cp, res) })

	t.Run("no permission", func(t *testing.T) {
		nobody, err := cp.UserKubeconfig("nobody")
		if err != nil {
			t.Fatal(err)
		}
		p, logs := publish(ctx, t, cp, nobody, "node-a", &stats{s: agent.Stats{Ready: true}})
		_ = testutil.Poll(wait, 50*time.Millisecond, func() error {
			if _, failed := p.Writes(); failed == 0 {
				return testutil.NotYet("a failed write")
			}
			return nil
		}) // the log says why, or that nothing failed
		if l := logs.String(); !strings.Contains(l, "cannot write the node's status") || !strings.Contains(l, "need=\"create and patch on ipmasqagentnodes") ||
			!strings.Contains(l, "need=\"get on nodes\"") {
			t.Errorf("log:\n%s", l)
		}
	})
}

// An agent of this version over a status written before the CRD had the status subresource
// (by an older agent, through the object itself): the first write replaces that status whole,
// so that what it no longer holds (a message, a rejection) does not stay, owned by no one.
func TestPublishAfterUpgrade(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cp := cluster.StartControlPlane(t, cluster.Options{})
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	crd := filepath.Join(root, "deploy", "crds", "ipmasqagentnodes.yaml")
	data, err := os.ReadFile(crd)
	if err != nil {
		t.Fatal(err)
	}
	before := strings.Replace(string(data), "      subresources:\n        status: {}\n", "", 1)
	if before == string(data) {
		t.Fatal("the CRD has no status subresource to remove")
	}
	old := filepath.Join(t.TempDir(), "ipmasqagentnodes-before.yaml")
	if err := os.WriteFile(old, []byte(before), 0o644); err != nil {
		t.Fatal(err)
	}
	established := func(file string) {
		t.Helper()
		if out, err := cp.Kubectl(ctx, "apply", "-f", file); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		if out, err := cp.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s", "crd/"+kube.Nodes.CRDName()); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
	}
	established(old)
	// The older agent's write: its status applied to the object itself.
	res := dynamic.NewForConfigOrDie(cp.Config).Resource(kube.Nodes.GVR())
	obj, err := json.Marshal(map[string]any{"apiVersion": kube.Nodes.APIVersion(), "kind": kube.Nodes.Kind, "metadata": map[string]any{"name": "node-u"},
		"status": map[string]any{"state": kube.StateDegraded, "message": "an old problem", "agentVersion": "old", "config": map[string]any{"source": "x"},
			"backend": map[string]any{"name": "fake"}, "rejected": map[string]any{"reason": "an old rejection"}}})
	if err != nil {
		t.Fatal(err)
	}
	force := true
	if err := testutil.Poll(wait, 100*time.Millisecond, func() error { // the CRD serves a moment after Established
		if _, err := res.Patch(ctx, "node-u", types.ApplyPatchType, obj, metav1.PatchOptions{FieldManager: nodestatus.FieldManager, Force: &force}); err != nil {
			return testutil.NotYet("the older agent's write: %v", err)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	established(crd)
	node(ctx, t, cp, "node-u")
	p, logs := publish(ctx, t, cp, cp.Kubeconfig, "node-u", &stats{s: agent.Stats{Ready: true}})
	// This agent's write, which replaces what the older agent's held: the replace may be seen
	// a moment after the write's own fields (a status read between the two is not the end).
	o := statusOf(ctx, t, res, "node-u", "this agent's write, the older agent's fields gone", func(o *unstructured.Unstructured) bool {
		return field(o, "status", "lastHeartbeatTime") != "" && field(o, "status", "message") == "" &&
			field(o, "status", "rejected", "reason") == ""
	})
	_ = testutil.Poll(wait, 20*time.Millisecond, func() error { // the server holds the write before the publisher counts it
		if ok, _ := p.Writes(); ok < 1 {
			return testutil.NotYet("%d writes", ok)
		}
		return nil
	})
	if field(o, "status", "message") != "" || field(o, "status", "rejected", "reason") != "" || field(o, "status", "state") != kube.StateReady {
		t.Errorf("status %v; want the older agent's message and rejection gone", o.Object["status"])
	}
	if ok, _ := p.Writes(); ok != 1 || !strings.Contains(logs.String(), "replaced the node's status") {
		t.Errorf("%d writes; log:\n%s", ok, logs)
	}
}
