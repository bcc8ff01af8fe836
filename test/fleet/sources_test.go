package fleet

import (
	"context"
	"encoding/json"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// selectorConfig has a rule by namespace (the partner namespaces keep their pods' addresses
// toward probeDst) and one by pod labels (batch pods leave behind the node's second address).
const selectorConfig = configMasq + `sourceRules:
- name: partner
  namespaceSelector: {matchLabels: {team: partner}}
  nonMasqueradeCIDRs: [10.0.0.0/8, 8.8.8.8/32]
- name: batch
  podSelector: {matchExpressions: [{key: role, operator: In, values: [batch]}]}
  masqueradeAddress: 10.99.0.11
`

// TestSourceSelectors, on every backend, an agent that reads its configuration and this node's
// pods from a real API server: two pods of the node (Pod objects bound to it, whose addresses are
// the topology's pods'), in two namespaces, send to the same destination and leave as their
// source rules say; a label change (of a pod, of a namespace) flips the verdict of the pod's new
// flows, and not of its established one; the time from the API write to the changed verdict is
// printed; a pod deleted and its address reused by a pod of another rule follows the new pod;
// and with the API server gone, the last mapping stays.
func TestSourceSelectors(t *testing.T) {
	eachBackend(t, func(ctx context.Context, t *testing.T, b e2e.Backend) {
		f := newFleet(ctx, t, b, 1)
		n := f.nodes[0]
		if err := n.env.AddAltAddresses(ctx); err != nil {
			t.Fatal(err)
		}
		pod2, pod2v4, _ := n.env.AddPod(ctx, t, 2)
		e2e.StartLineEcho(t, n.env.Ext, []netip.Addr{probeDst})
		core := f.cp.Client.CoreV1()
		for name, labels := range map[string]map[string]string{"team-a": {"team": "partner"}, "team-b": {"team": "web"}} {
			if _, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}},
				metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			// No controller manager makes it here; the service account admission wants it.
			if _, err := core.ServiceAccounts(name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
				metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		// podOn creates a pod bound to the node with the address, as the kubelet reports one.
		podOn := func(ns, name string, addr netip.Addr, labels map[string]string) {
			t.Helper()
			p, err := core.Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
				Spec: corev1.PodSpec{NodeName: n.name, Containers: []corev1.Container{{Name: "c", Image: "pause"}}}},
				metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: addr.String(), PodIPs: []corev1.PodIP{{IP: addr.String()}}}
			if _, err := core.Pods(ns).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		podOn("team-a", "a", e2e.PodAddr4, nil)
		podOn("team-b", "b", pod2v4, map[string]string{"role": "web"})

		cms := core.ConfigMaps("kube-system")
		if _, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: kube.DefaultConfigMapName},
			Data: map[string]string{kube.ConfigMapKey: selectorConfig}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		f.start(ctx, t, "configmap")

		type src struct {
			name, ns string
			addr     netip.Addr
		}
		a, bp := src{"pod a", n.env.Pod, e2e.PodAddr4}, src{"pod b", pod2, pod2v4}
		seen := func(s src) (netip.Addr, error) {
			got, err := n.env.ProbeFrom(ctx, s.ns, s.addr, "udp", probeDst)
			return got.Addr(), err
		}
		// wait polls until s's new flows leave as want, and returns how long that took from start.
		wait := func(what string, s src, want netip.Addr, start time.Time) {
			t.Helper()
			var last netip.Addr
			err := testutil.Poll(liveness, 2*time.Millisecond, func() error {
				got, err := seen(s)
				if last = got; err != nil || got != want {
					return testutil.NotYet("%s, %v", got, err)
				}
				return nil
			})
			if err != nil {
				t.Fatalf("%s: %s's new flows leave as %s, want %s: %v", what, s.name, last, want, err)
			}
			t.Logf("%s: API write to %s's changed verdict in the datapath: %v", what, s.name, time.Since(start).Round(time.Millisecond))
		}
		wait("start", a, e2e.PodAddr4, time.Now())
		wait("start", bp, e2e.NodeAddr4, time.Now())

		// An established connection of pod b, to see that it keeps its verdict.
		conn, err := e2e.DialLine(ctx, bp.ns, netip.AddrPortFrom(bp.addr, 0), probeDst)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if got, err := conn.Exchange("before"); err != nil || got.Addr() != e2e.NodeAddr4 {
			t.Fatalf("pod b's connection: seen from %s, %v", got, err)
		}

		label := func(kind, ns, name string, labels map[string]any) time.Time {
			t.Helper()
			patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": labels}})
			start := time.Now()
			var err error
			if kind == "pod" {
				_, err = core.Pods(ns).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
			} else {
				_, err = core.Namespaces().Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{})
			}
			if err != nil {
				t.Fatal(err)
			}
			return start
		}
		// explain, run beside the agent with its token: a pod by name (its labels read from the
		// API server), and an address the running agent's selectors chose.
		// The agent records what it applied a hair after the datapath has it: ask until then.
		explain := func(from, want string) {
			t.Helper()
			var out []byte
			err := testutil.Poll(10*time.Second, 50*time.Millisecond, func() error {
				var err error
				out, err = e2e.NSExec(ctx, n.env.Node, "", agentBin, "explain", "--kubeconfig="+n.kubeconfig, "--from="+from, probeDst.String())
				if err != nil || !strings.Contains(string(out), want) {
					return testutil.NotYet("%v", err)
				}
				return nil
			})
			if err != nil {
				t.Errorf("explain --from %s: %v:\n%s\nwant %q", from, err, out, want)
			}
		}
		explain("team-a/a", "from team-a/a (10.244.1.2): source rule partner (sourceRules[0]: namespaceSelector team=partner)")
		explain("team-b/b", "from team-b/b (10.244.2.2): no source rule holds it: the global keys decide")
		wait("pod b labelled role=batch", bp, e2e.NodeAlt4, label("pod", "team-b", "b", map[string]any{"role": "batch"}))
		explain(pod2v4.String(), "from 10.244.2.2: source rule batch (sourceRules[1]: selects the pod)")
		if got, err := conn.Exchange("after"); err != nil || got.Addr() != e2e.NodeAddr4 {
			t.Errorf("pod b's established connection after its label changed: seen from %s, %v; want %s as before", got, err, e2e.NodeAddr4)
		}
		wait("namespace team-a no longer partner", a, e2e.NodeAddr4, label("namespace", "", "team-a", map[string]any{"team": "web"}))
		wait("namespace team-a partner again", a, e2e.PodAddr4, label("namespace", "", "team-a", map[string]any{"team": "partner"}))

		// Pod b goes away and a partner pod takes its address: the address follows the new pod.
		if err := core.Pods("team-b").Delete(ctx, "b", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
			t.Fatal(err)
		}
		wait("pod b deleted", bp, e2e.NodeAddr4, time.Now())
		start := time.Now()
		podOn("team-a", "c", pod2v4, nil)
		wait("its address reused by a partner pod", bp, pod2v4, start)

		// Without the API server, the mapping stays.
		if err := f.cp.StopAPIServer(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Second) // the watches fail meanwhile
		for _, c := range []struct {
			s    src
			want netip.Addr
		}{{a, e2e.PodAddr4}, {bp, pod2v4}} {
			if got, err := seen(c.s); err != nil || got != c.want {
				t.Errorf("without the API server, %s leaves as %s, %v; want %s", c.s.name, got, err, c.want)
			}
		}
		if err := f.cp.StartAPIServer(ctx); err != nil {
			t.Fatal(err)
		}
		wait("the API server back, namespace team-a no longer partner", bp, e2e.NodeAddr4,
			label("namespace", "", "team-a", map[string]any{"team": "web"}))
	})
}
