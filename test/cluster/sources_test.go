package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ip-masq-agent/ip-masq-agent/internal/cluster"
)

// partnerConfig is agentConfig with a source rule: the pods of the partner namespaces keep
// their addresses toward outsideMasq, which the global keys masquerade.
var partnerConfig = agentConfig + `sourceRules:
- name: partner
  namespaceSelector: {matchLabels: {team: partner}}
  nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, ` + outsideMasq.String() + `/32]
`

// sourceSelectors installs the chart with a source rule by namespace (the ConfigMap watched
// through the API server): a new pod in a partner namespace keeps its address toward
// outsideMasq while the client pod is masqueraded; labelling the client's namespace flips the
// client's new flows. It measures the window in which a brand-new pod of the rule is decided by
// the global keys: from the pod's first answered packet to its first packet decided by the
// rule, the kubelet's report of its address and the agent's watch and apply in between.
func (w *world) sourceSelectors(ctx context.Context, t *testing.T, b backend) {
	v := w.values(b, w.img)
	v["configSource"] = "configmap"
	v["podSelectors"] = map[string]any{"enabled": true}
	v["config"] = partnerConfig
	helmInstall(t, w.c, v)
	waitDaemonSet(ctx, t, w.c, Release)
	w.forgetFlows(t)
	core := w.c.Client.CoreV1()
	if _, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "partner",
		Labels: map[string]string{"team": "partner"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := core.Namespaces().Delete(ctx, "partner", metav1.DeleteOptions{}); err != nil {
			t.Error(err)
		}
	}()
	w.checkFrom(ctx, t, w.client, w.podIP, cluster.NodeAddress)

	// A new pod of the rule: probe from its network namespace from the moment it exists.
	created := time.Now()
	pod, err := core.Pods("partner").Create(ctx, cluster.PausePod("partner-pod", nil), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := core.Pods("partner").Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
			t.Error(err)
		}
	}()
	var nsPath string
	wait(ctx, t, "the partner pod's network namespace", func() (err error) {
		nsPath, err = w.c.PodNetns(pod.UID)
		return err
	})
	probe := client{name: "partner-pod", nsPath: nsPath}
	dst := netip.AddrPortFrom(outsideMasq, WhoamiPort)
	var first, ruled time.Time
	var firstSeen netip.Addr
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		got, err := probe.whoami(short, "udp", dst)
		cancel()
		if err != nil {
			time.Sleep(2 * time.Millisecond)
			continue
		}
		now := time.Now()
		if first.IsZero() {
			first, firstSeen = now, got
		}
		if got != cluster.NodeAddress {
			ruled = now
			break
		}
	}
	p, err := core.Pods("partner").Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	podIP := netip.MustParseAddr(p.Status.PodIP)
	if ruled.IsZero() {
		t.Fatalf("the partner pod's flows to %s never kept its address %s within 2m (first answer at %v: seen as %s)",
			outsideMasq, podIP, first.Sub(created), firstSeen)
	}
	t.Logf("a new partner pod (%s): created, first packet answered %v later (seen as %s), first packet decided by its rule %v later: "+
		"a window of %v decided by the global keys", podIP, first.Sub(created).Round(time.Millisecond), firstSeen,
		ruled.Sub(created).Round(time.Millisecond), ruled.Sub(first).Round(time.Millisecond))
	w.checkFrom(ctx, t, probe, podIP, podIP)

	// The client's namespace joins the partners: the client's new flows keep its address.
	label := func(value any) time.Time {
		t.Helper()
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{"team": value}}})
		start := time.Now()
		if _, err := core.Namespaces().Patch(ctx, "default", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		return start
	}
	start := label("partner")
	wait(ctx, t, "the client pod's new flows kept", func() error {
		if got, err := w.client.whoami(ctx, "udp", dst); err != nil || got != w.podIP {
			return fmt.Errorf("seen as %s, %v", got, err)
		}
		return nil
	})
	t.Logf("namespace default labelled team=partner: the client's new flows keep its address %v after the write",
		time.Since(start).Round(time.Millisecond))
	w.checkFrom(ctx, t, w.client, w.podIP, w.podIP)
	label(nil)
	wait(ctx, t, "the client pod's new flows masqueraded again", func() error {
		if got, err := w.client.whoami(ctx, "udp", dst); err != nil || got != cluster.NodeAddress {
			return fmt.Errorf("seen as %s, %v", got, err)
		}
		return nil
	})
	w.uninstall(ctx, t)
}

// checkFrom checks what the outside sees of cl's new TCP and UDP flows: outsideKept always as
// podIP (every rule keeps 172.16.0.0/12), outsideMasq as want. UDP leaves from a fresh port:
// the probes before it, masqueraded by the global keys, are flows that keep their verdict.
func (w *world) checkFrom(ctx context.Context, t *testing.T, cl client, podIP, want netip.Addr) {
	t.Helper()
	for dst, expect := range map[netip.Addr]netip.Addr{outsideKept: podIP, outsideMasq: want} {
		for _, proto := range []string{"tcp", "udp"} {
			from := cl
			if proto == "udp" {
				from = cl.fresh()
			}
			got, err := from.whoami(ctx, proto, netip.AddrPortFrom(dst, WhoamiPort))
			if err != nil || got != expect {
				t.Errorf("%s from %s to %s: the outside saw %s, %v; want %s", proto, cl.name, dst, got, err, expect)
			}
		}
	}
}
