package nodestatus_test

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
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

func publish(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, kubeconfig, node string, st *stats) (*nodestatus.Publisher, *testutil.Buffer) {
	t.Helper()
	cfg, err := cp.RESTConfig(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testutil.Buffer{}
	p, err := nodestatus.New(cfg, nodestatus.Options{Node: node, Agent: st, Backend: &datapathtest.Backend{},
		Source: "configmap kube-system/ip-masq-agent", Reason: "--backend=fake", Delay: 200 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(logs, nil))})
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

func field(o *unstructured.Unstructured, path ...string) string {
	s, _, _ := unstructured.NestedString(o.Object, path...)
	return s
}

// The publisher against a real API server: the first write creates the node's object, owned by
// its Node; a state that does not change writes nothing; a change is written within the delay;
// without permission it says which it needs.
func TestPublish(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cp := cluster.StartControlPlane(t, cluster.Options{})
	root, err := cluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	if out, err := cp.Kubectl(ctx, "apply", "-f", filepath.Join(root, "deploy", "crds", "ipmasqagentnodes.yaml")); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if out, err := cp.Kubectl(ctx, "wait", "--for=condition=Established", "--timeout=60s", "crd/"+kube.Nodes.CRDName()); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	n, err := cp.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	res := dynamic.NewForConfigOrDie(cp.Config).Resource(kube.Nodes.GVR())

	st := &stats{s: agent.Stats{Ready: true, ConfigSHA256: strings.Repeat("0123456789abcdef", 4)}}
	p, _ := publish(ctx, t, cp, cp.Kubeconfig, "node-a", st)
	o := statusOf(ctx, t, res, "node-a", "the first write", func(*unstructured.Unstructured) bool { return true })
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
