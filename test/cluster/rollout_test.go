package cluster

import (
	"bufio"
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Log lines of the node lock's handover (pkg/cli).
const (
	// lockAcquired is the new agent's, once it holds the node lock.
	lockAcquired = "node lock acquired: this agent programs the node's datapath"
	// shutdownLine is the old agent's, when SIGTERM or a handover stops it: the datapath stays
	// for the next one.
	shutdownLine = "shutting down; the datapath stays in place"
	// With a surge, the new agent asks the old one to hand the node over, which it does and
	// then stands by until its pod is deleted.
	handingOver = "the node lock's holder hands the node over to this newer agent"
	handOver    = "a newer agent takes the node over: stopping; the datapath stays in place"
	standingBy  = "handed the node over; standing by until stopped"
)

// strategy is a DaemonSet rolling update's two knobs.
type strategy struct{ maxSurge, maxUnavailable int }

func (s strategy) String() string {
	return fmt.Sprintf("maxSurge=%d,maxUnavailable=%d", s.maxSurge, s.maxUnavailable)
}

// values are the chart's updateStrategy values for s.
func (s strategy) values() map[string]any {
	return map[string]any{"maxSurge": s.maxSurge, "maxUnavailable": s.maxUnavailable}
}

// rollout installs the previous release (its chart and image), updates it to this tree's
// (maxUnavailable 1: the old pod goes first, the new one adopts its datapath), updates that
// again with a surge (maxSurge 1, maxUnavailable 0, and a changed flag for a new pod template:
// the new pod starts beside the old one, whose agent hands the node over to it) and rolls back
// to the previous release, while long-lived TCP and UDP flows from the pod, masqueraded and
// not, keep being asked: none may fail or change the address the outside sees. The agents'
// logs show the node lock handed over each time.
func (w *world) rollout(ctx context.Context, t *testing.T, b backend) {
	helmInstallChart(t, w.c, w.prev.chart, w.values(b, w.prev))
	waitDaemonSet(ctx, t, w.c, Release)
	w.forgetFlows(t)
	flows := w.openFlows(ctx, t)
	defer flows.close()
	stop := flows.keepAsking(ctx)
	var logs []string // the agents' logs of each rollout, shown when a flow failed
	t.Run("update", func(t *testing.T) {
		logs = append(logs, w.rollTo(ctx, t, w.img, strategy{maxUnavailable: 1}, func() { helmInstall(t, w.c, w.values(b, w.img)) }))
	})
	t.Run("surge", func(t *testing.T) {
		s := strategy{maxSurge: 1}
		v := w.values(b, w.img, "--drift-check-interval=2s")
		v["updateStrategy"] = s.values()
		logs = append(logs, w.rollTo(ctx, t, w.img, s, func() { helmInstall(t, w.c, v) }))
	})
	t.Run("rollback", func(t *testing.T) {
		logs = append(logs, w.rollTo(ctx, t, w.prev, strategy{maxUnavailable: 1}, func() { helmRollback(t, w.c, 1) }))
	})
	errs, asked := stop()
	t.Logf("%d asks of %d flows during the rolling updates", asked, len(flows))
	if len(errs) > 0 {
		t.Errorf("flows failed during the rolling updates (%d of %d asks):\n%s\n\n%s", len(errs), asked, strings.Join(errs, "\n"), strings.Join(logs, "\n"))
	}
	w.uninstall(ctx, t)
}

// rollTo runs change (an upgrade or a rollback) and waits until the DaemonSet's pod is a new
// one running img; the new agent's log must say it took the node lock, the old one's that it
// left the datapath in place. With a surge, the new agent's must say the old one handed the
// node over, and the old one's that it did and stood by. It returns both agents' logs.
func (w *world) rollTo(ctx context.Context, t *testing.T, img agentImage, s strategy, change func()) string {
	t.Helper()
	old := waitDaemonSet(ctx, t, w.c, Release)
	oldLog := w.followLog(ctx, t, old)
	start := time.Now()
	change()
	pod := w.waitRolledOut(ctx, t, old.UID, img)
	t.Logf("%s to %s: started %s, rolled out in %v", s, img.tag, start.Format("15:04:05.000"), time.Since(start).Round(time.Millisecond))
	logs := podLogs(ctx, t, w.c, pod, "ip-masq-agent")
	want := []string{lockAcquired}
	oldWant := []string{shutdownLine}
	if s.maxSurge > 0 {
		want = append(want, handingOver)
		oldWant = append(oldWant, handOver, standingBy)
	}
	for _, line := range want {
		if !strings.Contains(logs, line) {
			t.Errorf("the new agent's log does not say %q:\n%s", line, logs)
		}
	}
	wait(ctx, t, "the old agent's last words", func() error {
		for _, line := range oldWant {
			if !strings.Contains(oldLog.String(), line) {
				return fmt.Errorf("no %q; its log ends:\n%s", line, testutil.LastLines(oldLog.String(), 5))
			}
		}
		return nil
	})
	return fmt.Sprintf("%s to %s: the old agent's log\n%s\nthe new agent's log\n%s", s, img.tag, oldLog.String(), logs)
}

// values are the chart's values for backend b running image img, with more agent flags.
func (w *world) values(b backend, img agentImage, args ...string) map[string]any {
	var extra []any
	for _, a := range append(slices.Clip(b.args), args...) {
		extra = append(extra, a)
	}
	return map[string]any{
		"image":     map[string]any{"tag": img.tag, "pullPolicy": "Never"},
		"backend":   b.flag,
		"extraArgs": extra,
		"config":    agentConfig,
	}
}

// waitRolledOut waits until the DaemonSet's one pod is a new one (not old) running img, ready,
// and the old one is gone; it returns the new pod.
func (w *world) waitRolledOut(ctx context.Context, t *testing.T, old types.UID, img agentImage) *corev1.Pod {
	t.Helper()
	var pod *corev1.Pod
	wait(ctx, t, "rolled out to "+img.tag, func() error {
		pods, err := w.c.Client.CoreV1().Pods(Namespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ip-masq-agent"})
		if err != nil {
			return err
		}
		if len(pods.Items) != 1 {
			var s []string
			for _, p := range pods.Items {
				s = append(s, p.Name+" "+string(p.Status.Phase)+" "+describe(&p))
			}
			if len(pods.Items) == 0 {
				s = append(s, "the DaemonSet's last warning: "+lastWarning(ctx, w.c, "DaemonSet", Release))
			}
			return fmt.Errorf("%d pods: %s", len(pods.Items), strings.Join(s, "; "))
		}
		p := &pods.Items[0]
		if p.UID == old || !strings.HasSuffix(p.Spec.Containers[0].Image, ":"+img.tag) {
			return fmt.Errorf("the pod is still %s (%s)", p.Name, p.Spec.Containers[0].Image)
		}
		if p.Status.Phase != corev1.PodRunning || len(p.Status.ContainerStatuses) == 0 || !p.Status.ContainerStatuses[0].Ready {
			return fmt.Errorf("the new pod %s is not ready: %s", p.Name, describe(p))
		}
		pod = p
		return nil
	})
	return pod
}

// lastWarning is the message of the latest warning event about the object (kind, name) in
// Namespace, such as why a DaemonSet creates no pod; "none" when there is none.
func lastWarning(ctx context.Context, c *cluster.Cluster, kind, name string) string {
	evs, err := c.Client.CoreV1().Events(Namespace).List(ctx, metav1.ListOptions{
		FieldSelector: "type=Warning,involvedObject.kind=" + kind + ",involvedObject.name=" + name})
	if err != nil {
		return "cannot list events: " + err.Error()
	}
	last := "none"
	var at time.Time
	for _, e := range evs.Items {
		if t := e.LastTimestamp.Time; last == "none" || t.After(at) {
			last, at = e.Reason+": "+e.Message, t
		}
	}
	return last
}

// describe is a pod's containers' states, for a timeout's error.
func describe(p *corev1.Pod) string {
	var s []string
	for _, cs := range p.Status.ContainerStatuses {
		st := "running"
		switch {
		case cs.State.Waiting != nil:
			st = "waiting " + cs.State.Waiting.Reason
		case cs.State.Terminated != nil:
			st = "terminated " + cs.State.Terminated.Reason
		}
		s = append(s, fmt.Sprintf("%s %s ready=%v restarts=%d", cs.Name, st, cs.Ready, cs.RestartCount))
	}
	return strings.Join(s, ", ")
}

// followLog streams a pod's log into a buffer until the pod ends: the log of a pod the
// rollout deletes is gone from the API afterwards.
func (w *world) followLog(ctx context.Context, t *testing.T, pod *corev1.Pod) *testutil.Buffer {
	t.Helper()
	buf := &testutil.Buffer{}
	stream, err := w.c.Client.CoreV1().Pods(Namespace).GetLogs(pod.Name, &corev1.PodLogOptions{Container: "ip-masq-agent", Follow: true}).Stream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer stream.Close()
		sc := bufio.NewScanner(stream)
		for sc.Scan() {
			_, _ = buf.Write(append(sc.Bytes(), '\n'))
		}
	}()
	return buf
}

// forgetFlows deletes the node's conntrack entries of the client pod's flows. A BPF datapath
// masquerades after netfilter, so the entries of an earlier test's flows hold no NAT, and a new
// connection reusing one's tuple (a UDP source port, within the entry's 120 s) would leave the
// node unmasqueraded by a netfilter backend, which only translates a connection's first packet.
func (w *world) forgetFlows(t *testing.T) {
	t.Helper()
	ns, err := netns.GetFromName(w.c.Node)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := h.SetSocketTimeout(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	f := &netlink.ConntrackFilter{}
	if err := f.AddIP(netlink.ConntrackOrigSrcIP, w.podIP.AsSlice()); err != nil {
		t.Fatal(err)
	}
	n, err := h.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, f)
	if err != nil {
		t.Fatalf("forget the client pod's conntrack entries: %v", err)
	}
	t.Logf("the node's conntrack forgot %d entries of the client pod's earlier flows", n)
}

// liveFlow is one flow from the client pod and the address the outside must see: a long-lived
// one (f), or, with f nil, a new connection at every ask, which only a datapath installed at
// that moment masquerades (a held flow may outlive its rules in conntrack).
type liveFlow struct {
	name string
	f    *flow
	want netip.Addr
	// A new connection's.
	cl    client
	proto string
	dst   netip.AddrPort
}

func (lf liveFlow) ask(ctx context.Context) (netip.Addr, error) {
	if lf.f != nil {
		return lf.f.ask(ctx)
	}
	return lf.cl.whoami(ctx, lf.proto, lf.dst)
}

type liveFlows []liveFlow

// openFlows opens TCP and UDP flows from the client pod to a kept and a masqueraded outside
// address, each checked once, and adds new TCP and UDP connections to the masqueraded one.
func (w *world) openFlows(ctx context.Context, t *testing.T) liveFlows {
	t.Helper()
	var fs liveFlows
	for _, dst := range []struct {
		addr netip.Addr
		want netip.Addr
	}{{outsideKept, w.podIP}, {outsideMasq, cluster.NodeAddress}} {
		for _, proto := range []string{"tcp", "udp"} {
			f, err := w.client.open(ctx, proto, netip.AddrPortFrom(dst.addr, WhoamiPort))
			if err != nil {
				t.Fatal(err)
			}
			lf := liveFlow{name: fmt.Sprintf("%s to %s", proto, dst.addr), f: f, want: dst.want}
			if got, err := f.ask(ctx); err != nil || got != dst.want {
				t.Fatalf("%s: the outside saw %s (%v), want %s", lf.name, got, err, dst.want)
			}
			fs = append(fs, lf)
		}
	}
	for _, proto := range []string{"tcp", "udp"} {
		fs = append(fs, liveFlow{name: fmt.Sprintf("new %s connections to %s", proto, outsideMasq), want: cluster.NodeAddress,
			cl: w.client, proto: proto, dst: netip.AddrPortFrom(outsideMasq, WhoamiPort)})
	}
	return fs
}

// keepAsking asks every flow every 100 ms until the returned function is called, which
// returns every failure seen and how many asks there were.
func (fs liveFlows) keepAsking(ctx context.Context) func() ([]string, int) {
	var mu sync.Mutex
	var errs []string
	asked := 0
	done := make(chan struct{})
	var wg sync.WaitGroup
	for _, lf := range fs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-done:
					return
				case <-time.After(100 * time.Millisecond):
				}
				got, err := lf.ask(ctx)
				mu.Lock()
				asked++
				if err != nil || got != lf.want {
					errs = append(errs, fmt.Sprintf("%s %s: the outside saw %s (%v), want %s", time.Now().Format("15:04:05.000"), lf.name, got, err, lf.want))
				}
				mu.Unlock()
				if err != nil && lf.f != nil && lf.f.proto == "tcp" {
					return // a broken TCP connection stays broken
				}
			}
		}()
	}
	return func() ([]string, int) {
		close(done)
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		return errs, asked
	}
}

func (fs liveFlows) close() {
	for _, lf := range fs {
		if lf.f != nil {
			lf.f.conn.Close()
		}
	}
}
