package podsource_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/podsource"
)

// TestMain quiets client-go's own logs (klog, global: set before any informer runs), which
// the watcher's say again.
func TestMain(m *testing.M) {
	kube.LogTo(slog.New(slog.DiscardHandler))
	os.Exit(m.Run())
}

// wait bounds each wait for a change: a watch event arrives in milliseconds; the bound is for
// the API server's restart and the informers' backoff after it.
const wait = 60 * time.Second

// node is the node the watcher watches; other is another one.
const node, other = "node-a", "node-b"

// rules: pods in namespaces of team batch, and canary pods anywhere; a CIDR rule that selects
// nothing through the API.
func rules(t *testing.T) []config.SourceRule {
	t.Helper()
	cfg, err := config.Parse([]byte(`sourceRules:
- {name: cidr, cidrs: [10.99.0.0/16], masqOutBound: false}
- {name: batch, namespaceSelector: {matchLabels: {team: batch}}, masqOutBound: false}
- {name: canary, podSelector: {matchExpressions: [{key: track, operator: In, values: [canary]}]}, masqOutBound: false}
`), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return cfg.SourceRules
}

// watching is a watcher being watched, with its log.
type watching struct {
	*podsource.Watcher
	rules   []config.SourceRule
	changes <-chan struct{}
	log     *testutil.Buffer
}

func watch(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, rs []config.SourceRule) *watching {
	t.Helper()
	return watchAs(ctx, t, cp, cp.Kubeconfig, rs)
}

// watchAs is watch through the client of a kubeconfig file.
func watchAs(ctx context.Context, t *testing.T, cp *cluster.ControlPlane, kubeconfig string, rs []config.SourceRule) *watching {
	t.Helper()
	cfg, err := cp.RESTConfig(kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	l := &testutil.Buffer{}
	w, err := podsource.New(cfg, podsource.Options{Node: node, Logger: slog.New(slog.NewTextHandler(l, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	changes, err := w.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		for range changes { // closed once the watcher stopped
		}
		if t.Failed() {
			t.Logf("watcher log:\n%s", l)
		}
	})
	return &watching{Watcher: w, rules: rs, changes: changes, log: l}
}

// mapping is a Select's answer as text: "rule=addr,addr rule=..." in the order of the rules.
func mapping(m map[string][]netip.Addr) string {
	var parts []string
	for _, r := range []string{"batch", "canary"} {
		as, ok := m[r]
		if !ok {
			continue
		}
		s := make([]string, len(as))
		for i, a := range as {
			s[i] = a.String()
		}
		parts = append(parts, r+"="+strings.Join(s, ","))
	}
	return strings.Join(parts, " ")
}

// until selects at each change report until the mapping is want; it returns how long that
// took from start, and the event time Select gave.
func (w *watching) until(t *testing.T, what, want string, start time.Time) (took time.Duration, since time.Time) {
	t.Helper()
	var got string
	var err error
	deadline := time.After(wait)
	for {
		select {
		case _, ok := <-w.changes:
			if !ok {
				t.Fatalf("%s: the watcher stopped", what)
			}
		case <-deadline:
			t.Fatalf("%s: mapping %q, %v; want %q within %v", what, got, err, want, wait)
		}
		var m map[string][]netip.Addr
		var s time.Time
		m, s, err = w.Select(w.rules)
		if !s.IsZero() {
			since = s
		}
		if got = mapping(m); err == nil && got == want {
			return time.Since(start), since
		}
	}
}

// quiet takes the change reports already made, until none comes for a second.
func (w *watching) quiet(t *testing.T) {
	t.Helper()
	for {
		select {
		case _, ok := <-w.changes:
			if !ok {
				t.Fatal("the watcher stopped")
			}
		case <-time.After(time.Second):
			return
		}
	}
}

// pods writes pods as a kubelet and the scheduler would.
type pods struct {
	ctx context.Context
	t   *testing.T
	cp  *cluster.ControlPlane
}

// run creates a pod bound to node n, running with the addresses ips.
func (p pods) run(ns, name, n string, labels map[string]string, hostNetwork bool, ips ...string) *corev1.Pod {
	p.t.Helper()
	c := p.cp.Client.CoreV1().Pods(ns)
	pod, err := c.Create(p.ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec: corev1.PodSpec{NodeName: n, HostNetwork: hostNetwork, Containers: []corev1.Container{{Name: "c", Image: "pause"}}}},
		metav1.CreateOptions{})
	if err != nil {
		p.t.Fatal(err)
	}
	pod.Status.Phase = corev1.PodRunning
	for _, ip := range ips {
		pod.Status.PodIPs = append(pod.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	pod.Status.PodIP = ips[0]
	if pod, err = c.UpdateStatus(p.ctx, pod, metav1.UpdateOptions{}); err != nil {
		p.t.Fatal(err)
	}
	return pod
}

// patch merge-patches an object of the core API (status when sub is "status").
func (p pods) patch(kind, ns, name, patch string, sub ...string) {
	p.t.Helper()
	var err error
	switch kind {
	case "pod":
		_, err = p.cp.Client.CoreV1().Pods(ns).Patch(p.ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}, sub...)
	case "namespace":
		_, err = p.cp.Client.CoreV1().Namespaces().Patch(p.ctx, name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	}
	if err != nil {
		p.t.Fatal(err)
	}
}

func (p pods) namespace(name string, labels map[string]string) {
	p.t.Helper()
	if _, err := p.cp.Client.CoreV1().Namespaces().Create(p.ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}},
		metav1.CreateOptions{}); err != nil {
		p.t.Fatal(err)
	}
	// No controller manager makes it: the ServiceAccount admission wants it for pods.
	if _, err := p.cp.Client.CoreV1().ServiceAccounts(name).Create(p.ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil {
		p.t.Fatal(err)
	}
}

// TestWatcher follows the node's pods against a real API server: namespace and pod labels
// change, a pod ends, leaves, and its address comes back with a newer pod; pods of another
// node and on the host's network never count. The latency of each change, from the API write
// to the watcher's report and mapping, is logged. The API server then goes away: the mapping
// stays, and follows again once it is back.
func TestWatcher(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cp := cluster.StartControlPlane(t, cluster.Options{})
	p := pods{ctx: ctx, t: t, cp: cp}
	p.namespace("batch", map[string]string{"team": "batch"})
	p.namespace("web", map[string]string{"team": "web"})
	p.namespace("misc", nil)

	old := p.run("batch", "job", node, nil, false, "10.244.0.10")
	p.run("web", "canary", node, map[string]string{"track": "canary"}, false, "10.244.0.11", "fd00::11")
	p.run("web", "elsewhere", other, map[string]string{"track": "canary"}, false, "10.244.1.5")
	p.run("batch", "host", node, nil, true, "192.168.1.1")

	w := watch(ctx, t, cp, rules(t))
	if _, _, err := w.Select(w.rules); !errors.Is(err, podsource.ErrUnknown) {
		t.Fatalf("Select before the first list: %v; want ErrUnknown", err)
	}
	took, _ := w.until(t, "the first list", "batch=10.244.0.10 canary=10.244.0.11,fd00::11", time.Now())
	t.Logf("first list: mapping in %v", took.Round(time.Microsecond))
	w.quiet(t)

	var latencies []time.Duration
	step := func(what, want string, write func()) {
		t.Helper()
		start := time.Now()
		write()
		took, since := w.until(t, what, want, start)
		latencies = append(latencies, took)
		t.Logf("%-40s write -> report and mapping %8v (watch event received -> mapping %v)", what+":", took.Round(time.Microsecond),
			time.Since(since).Round(time.Microsecond))
		w.quiet(t)
	}
	step("namespace labels change", "batch=10.244.0.10,10.244.0.11,fd00::11 canary=10.244.0.11,fd00::11", func() {
		p.patch("namespace", "", "web", `{"metadata":{"labels":{"team":"batch"}}}`)
	})
	step("pod labels change", "batch=10.244.0.10,10.244.0.11,fd00::11 canary=", func() {
		p.patch("pod", "web", "canary", `{"metadata":{"labels":{"track":null}}}`)
	})
	step("namespace labels change back", "batch=10.244.0.10 canary=", func() {
		p.patch("namespace", "", "web", `{"metadata":{"labels":{"team":"web"}}}`)
	})
	step("pod of a namespace selected", "batch=10.244.0.10,10.244.0.12 canary=", func() {
		p.run("batch", "job2", node, nil, false, "10.244.0.12")
	})
	step("pod ends (Succeeded)", "batch=10.244.0.10 canary=", func() {
		p.patch("pod", "batch", "job2", `{"status":{"phase":"Succeeded"}}`, "status")
	})
	// The old pod's status still says Running with the address a newer pod, chosen by no rule,
	// has now: the address is the newer pod's. Creation times have a resolution of a second.
	for time.Now().Truncate(time.Second).Equal(old.CreationTimestamp.Time) {
		time.Sleep(100 * time.Millisecond)
	}
	step("address reused by a newer pod", "batch= canary=", func() {
		p.run("misc", "reuse", node, nil, false, "10.244.0.10")
	})
	step("the newer pod leaves", "batch=10.244.0.10 canary=", func() {
		if err := cp.Client.CoreV1().Pods("misc").Delete(ctx, "reuse", gone); err != nil {
			t.Fatal(err)
		}
	})
	step("pod leaves", "batch= canary=", func() {
		if err := cp.Client.CoreV1().Pods("batch").Delete(ctx, "job", gone); err != nil {
			t.Fatal(err)
		}
	})
	step("canary pod with a namespace selected", "batch=10.244.0.13 canary=10.244.0.13", func() {
		p.run("batch", "both", node, map[string]string{"track": "canary"}, false, "10.244.0.13")
	})
	slices.Sort(latencies)
	t.Logf("API write -> change report and mapping over %d changes: min %v, median %v, max %v", len(latencies),
		latencies[0].Round(time.Microsecond), latencies[len(latencies)/2].Round(time.Microsecond), latencies[len(latencies)-1].Round(time.Microsecond))

	// Events of pods on other nodes and on the host's network change nothing: no report.
	p.patch("pod", "web", "elsewhere", `{"metadata":{"labels":{"team":"x"}}}`)
	p.patch("pod", "batch", "host", `{"metadata":{"labels":{"track":"canary"}}}`)
	select {
	case <-w.changes:
		m, _, err := w.Select(w.rules)
		t.Errorf("a change reported for pods the rules cannot choose: %s, %v", mapping(m), err)
	case <-time.After(2 * time.Second):
	}

	t.Run("API server lost", func(t *testing.T) {
		want := "batch=10.244.0.13 canary=10.244.0.13"
		if err := cp.StopAPIServer(); err != nil {
			t.Fatal(err)
		}
		if err := testutil.Poll(wait, 100*time.Millisecond, func() error {
			if w.Unreachable() == nil {
				return testutil.NotYet("the watcher has not seen the loss")
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		// Long enough for the informers to fail a relist or two.
		time.Sleep(3 * time.Second)
		if m, _, err := w.Select(w.rules); err != nil || mapping(m) != want {
			t.Errorf("while the API server is gone: %s, %v; want %s", mapping(m), err, want)
		}
		if err := cp.StartAPIServer(ctx); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		w.patch(t, p)
		took, _ := w.until(t, "an edit after the return", "batch=10.244.0.13 canary=", start)
		t.Logf("after the API server's return: an edit in the mapping within %v of the server's readiness", took.Round(time.Millisecond))
		if w.Unreachable() != nil {
			t.Errorf("Unreachable %v after the return", w.Unreachable())
		}
		l := w.log.String()
		if n := strings.Count(l, "cannot read the node's pods from the API server; the selected pods stay as they were"); n != 1 {
			t.Errorf("%d lines about the loss, want 1", n)
		}
		if !strings.Contains(l, "the API server answers again") {
			t.Error("the return is not logged")
		}
	})

	t.Run("no permission", func(t *testing.T) {
		nobody, err := cp.UserKubeconfig("nobody")
		if err != nil {
			t.Fatal(err)
		}
		w := watchAs(ctx, t, cp, nobody, rules(t))
		if err := testutil.Poll(wait, 50*time.Millisecond, func() error {
			_, _, err := w.Select(w.rules)
			if !errors.Is(err, podsource.ErrUnknown) || !strings.Contains(err.Error(), "forbidden") || !strings.Contains(err.Error(), podsource.Permission) {
				return testutil.NotYet("Select: %v; want ErrUnknown naming the refusal and the permission", err)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		if l := w.log.String(); !strings.Contains(l, "need=") {
			t.Errorf("the refusal is not logged with the permission:\n%s", l)
		}
	})

	t.Run("no selector rule", func(t *testing.T) {
		if m, _, err := w.Select(rules(t)[:1]); err != nil || m != nil {
			t.Fatalf("Select of a CIDR rule only: %v, %v; want nothing", m, err)
		}
		if !strings.Contains(w.log.String(), "no source rule selects pods; stopped watching them") {
			t.Error("the stop is not logged")
		}
		// Following again lists again.
		if _, _, err := w.Select(w.rules); !errors.Is(err, podsource.ErrUnknown) {
			t.Fatalf("Select after a restart: %v; want ErrUnknown until the list", err)
		}
		w.until(t, "the list after the restart", "batch=10.244.0.13 canary=", time.Now())
	})
}

// gone deletes a pod at once, as the kubelet's last delete does once its containers stopped (a
// graceful deletion keeps the pod, still running, until then).
var gone = metav1.DeleteOptions{GracePeriodSeconds: new(int64(0))}

// patch is the edit after the API server's return, retried while it settles.
func (w *watching) patch(t *testing.T, p pods) {
	t.Helper()
	if err := testutil.Poll(wait, 200*time.Millisecond, func() error {
		_, err := p.cp.Client.CoreV1().Pods("batch").Patch(p.ctx, "both", types.MergePatchType,
			[]byte(`{"metadata":{"labels":{"track":"stable"}}}`), metav1.PatchOptions{})
		if err != nil {
			return testutil.NotYet("patch: %v", err)
		}
		return nil
	}); err != nil {
		t.Fatal(fmt.Errorf("patch after the return: %w", err))
	}
}
