package cluster

import (
	"context"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// configMapDeadline bounds an edit's way from the API to the datapath: the kubelet projects a
// changed ConfigMap on its pod sync (a minute by default) plus its cache's delay, so this is a
// liveness bound well above that, not a speed target.
const configMapDeadline = 3 * time.Minute

// editConfigMap edits the agent's ConfigMap through the API so that outsideMasq is kept, and
// times the way to the datapath: from the API write to the kubelet's projection of the file in
// the agent's container (the kubelet's part), and from there to the pod's traffic keeping its
// address (the agent's part). Both are printed, neither asserted: the speed is the kubelet's
// sync period and the benchmarks' business.
func (w *world) editConfigMap(ctx context.Context, t *testing.T, agent agentPod) {
	t.Helper()
	cms := w.c.Client.CoreV1().ConfigMaps(Namespace)
	cm, err := cms.Get(ctx, "ip-masq-agent", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	before := cm.Data["config"]
	edited := strings.Replace(before, "nonMasqueradeCIDRs:\n", "nonMasqueradeCIDRs:\n  - "+netip.PrefixFrom(outsideMasq, 24).Masked().String()+"\n", 1)
	if edited == before {
		t.Fatalf("no nonMasqueradeCIDRs in the ConfigMap:\n%s", before)
	}
	if want := explain(t, edited, outsideMasq)[outsideMasq]; want != "pod" {
		t.Fatalf("explain says %s for %s after the edit, want pod", want, outsideMasq)
	}
	file := "/proc/" + strconv.Itoa(agent.pid) + "/root/etc/config/ip-masq-agent"
	cm.Data["config"] = edited
	if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	written := time.Now()
	within, cancel := context.WithDeadline(ctx, written.Add(configMapDeadline))
	defer cancel()
	if err := testutil.PollContext(within, 50*time.Millisecond, func() error {
		if b, err := os.ReadFile(file); err != nil || string(b) != edited {
			return testutil.NotYet("the edit in %s (%v)", file, err)
		}
		return nil
	}); err != nil {
		t.Fatalf("the kubelet did not project the edit within %v: %v", configMapDeadline, err)
	}
	projected := time.Now()
	if err := testutil.PollContext(within, 20*time.Millisecond, func() error {
		if got, err := w.client.whoami(ctx, "tcp", netip.AddrPortFrom(outsideMasq, WhoamiPort)); err != nil || got != w.podIP {
			return testutil.NotYet("the pod's own address to be seen (last: %s, %v)", got, err)
		}
		return nil
	}); err != nil {
		t.Fatalf("the pod's traffic to %s is still masqueraded %v after the edit: %v", outsideMasq, configMapDeadline, err)
	}
	changed := time.Now()
	t.Logf("ConfigMap edit to changed verdict: %v (the kubelet's projection %v, then the agent %v, give or take the 50 ms file poll)",
		changed.Sub(written).Round(time.Millisecond), projected.Sub(written).Round(time.Millisecond), changed.Sub(projected).Round(time.Millisecond))
	w.checkMasquerade(ctx, t, edited)
}

// agentPod is the agent's running pod and its process.
type agentPod struct {
	pid int
}

// findAgent finds the process of the agent's DaemonSet pod.
func (w *world) findAgent(ctx context.Context, t *testing.T) agentPod {
	t.Helper()
	pod := waitDaemonSet(ctx, t, w.c, Release)
	pid, err := w.c.PodProcess(pod.UID, "ip-masq-agent")
	if err != nil {
		t.Fatal(err)
	}
	return agentPod{pid: pid}
}
