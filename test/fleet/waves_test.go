package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/rollout"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// The rollout controller's plan here: three nodes in three waves (1% is one node, 50% two, then
// all), each held a few seconds.
const (
	testWaves = "1,50,100"
	testHold  = 4 * time.Second
)

// configMissingAddress is valid (the admission policy lets it through) but wrong on every node:
// its masquerade address is on none of them, so an agent that reads it refuses it.
const configMissingAddress = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeAddress: 203.0.113.99\n"

// TestRolloutInWaves, on every backend, three agents and the rollout controller with the RBAC of
// deploy/rbac/rollout: a good generation reaches one node, then two, then all, each wave after
// the hold (the time the three waves take is printed); a valid but wrong one reaches only the
// canary and halts the rollout, while the other nodes keep the good one and the table of
// kubectl get says why; putting the good spec back reaches every node at once; deleting the
// object changes no node (each says so, in its status and a metric), and an object with an
// empty spec brings the defaults.
func TestRolloutInWaves(t *testing.T) {
	eachBackend(t, func(ctx context.Context, t *testing.T, b e2e.Backend) {
		f := newFleet(ctx, t, b, 3)
		crs := dynamic.NewForConfigOrDie(f.cp.Config).Resource(kube.Configs.GVR())
		if _, err := crs.Create(ctx, ipMasqAgentConfig(kube.DefaultConfigName, spec(t, configMasq)), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		f.startController(ctx, t)
		f.waitRollout(ctx, t, 1, kube.RolloutComplete)
		f.start(ctx, t, "crd")
		// The controller knows the nodes by their statuses.
		f.waitStatus(ctx, t, kube.StateReady, hashOf(t, configMasq))
		order := f.waveOrder()
		t.Logf("the waves' order of the nodes (by rollout.NodeHash): %v", order)

		// A good generation: one node, then two, then three.
		setSpec := func(doc string) { // the whole spec, as docs/operations.md's roll back does
			patch, _ := json.Marshal([]map[string]any{{"op": "replace", "path": "/spec", "value": spec(t, doc)}})
			if _, err := crs.Patch(ctx, kube.DefaultConfigName, types.JSONPatchType, patch, metav1.PatchOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		start := time.Now()
		setSpec(configKeep)
		for wave := 1; wave <= 2; wave++ {
			f.waitRolloutWave(ctx, t, 2, wave)
			released := order[:wave]
			f.waitVerdicts(ctx, t, fmt.Sprintf("wave %d", wave), released, e2e.Keep)
			// The nodes not released keep the stable generation through the wave's hold.
			for _, n := range f.nodes {
				if !slices.Contains(released, n.name) {
					if w, err := verdict(ctx, n); err != nil || w != e2e.Masq {
						t.Errorf("wave %d: %s, not released, sees %v, %v", wave, n.name, w, err)
					}
				}
			}
			t.Logf("wave %d (%v) out %v after the write", wave, released, time.Since(start).Round(time.Millisecond))
		}
		r := f.waitRollout(ctx, t, 2, kube.RolloutComplete)
		t.Logf("a 3-wave rollout of 3 nodes (hold %v): %v from the write to Complete", testHold, time.Since(start).Round(time.Millisecond))
		f.waitVerdicts(ctx, t, "the last wave", order, e2e.Keep)
		if r.Stable == nil || r.Stable.Generation != 2 || r.Updated != 3 || r.Nodes != 3 {
			t.Errorf("after the rollout: %+v", r)
		}
		f.waitStatus(ctx, t, kube.StateReady, hashOf(t, configKeep))

		// A valid but wrong generation: the canary refuses it, and the rollout halts there.
		setSpec(configMissingAddress)
		r = f.waitRollout(ctx, t, 3, kube.RolloutHalted)
		if !strings.HasPrefix(r.Reason, order[0]+": ") || !strings.Contains(r.Reason, "203.0.113.99") {
			t.Errorf("halted because %q; want the canary %s and the missing address", r.Reason, order[0])
		}
		table := kubectl(ctx, t, f.cp, "get", kube.Configs.Plural, "-o", "wide")
		t.Logf("after a wrong generation:\n%s", table)
		if !strings.Contains(table, kube.RolloutHalted) || !strings.Contains(table, order[0]) {
			t.Errorf("kubectl get does not show the halt and its node:\n%s", table)
		}
		time.Sleep(2 * testHold) // more waves would go out by now
		if r := f.rolloutState(ctx, t); r.Phase != kube.RolloutHalted || r.Wave != 1 {
			t.Errorf("the halted rollout moved on: %+v", r)
		}
		st := f.statuses(ctx, t)
		for _, n := range f.nodes {
			if g, _, _ := unstructured.NestedInt64(st[n.name].Object, "status", "config", "generation"); g != 2 {
				t.Errorf("%s: generation %d in force, want the good one's (2)", n.name, g)
			}
			if w, err := verdict(ctx, n); err != nil || w != e2e.Keep {
				t.Errorf("%s: %v, %v after the wrong generation; want the good one's verdict", n.name, w, err)
			}
		}

		// Putting the good spec back (the documented roll back) reaches every node at once.
		setSpec(configKeep)
		r = f.waitRollout(ctx, t, 4, kube.RolloutComplete)
		if !strings.Contains(r.Reason, "stable configuration of generation 2") {
			t.Errorf("rolled back because %q", r.Reason)
		}
		f.waitStatus(ctx, t, kube.StateReady, hashOf(t, configKeep))

		// A deleted object is not an instruction: every node keeps what it applied and says so;
		// an object with an empty spec is how to ask for the defaults.
		if err := crs.Delete(ctx, kube.DefaultConfigName, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		eventually(t, "every node saying the object is deleted", liveness, func() bool {
			st := f.statuses(ctx, t)
			for _, n := range f.nodes {
				if conditionStatus(st[n.name], kube.ConditionConfigObjectPresent) != "False" {
					return false
				}
			}
			return true
		})
		for _, n := range f.nodes {
			if w, err := verdict(ctx, n); err != nil || w != e2e.Keep {
				t.Errorf("%s: %v, %v after the deletion; want the configuration in force kept", n.name, w, err)
			}
			if _, body, err := n.agent.Get(ctx, "/metrics"); err != nil || !strings.Contains(body, "\nip_masq_agent_config_source_deleted 1\n") {
				t.Errorf("%s: ip_masq_agent_config_source_deleted is not 1 (%v)", n.name, err)
			}
		}
		f.rollout(ctx, t, "an empty spec after the deletion", e2e.Masq, func() {
			if _, err := crs.Create(ctx, ipMasqAgentConfig(kube.DefaultConfigName, map[string]any{}), metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		})
	})
}

// conditionStatus is the status of the condition typ of an IPMasqAgentNode, "" when it has none.
func conditionStatus(o *unstructured.Unstructured, typ string) string {
	conds, _, _ := unstructured.NestedSlice(o.Object, "status", "conditions")
	for _, c := range conds {
		if m, ok := c.(map[string]any); ok && m["type"] == typ {
			s, _ := m["status"].(string)
			return s
		}
	}
	return ""
}

// startController runs the rollout controller with its service account's token and RBAC, as a
// pod of its Deployment would.
func (f *fleet) startController(ctx context.Context, t *testing.T) {
	t.Helper()
	kubectl(ctx, t, f.cp, "apply", "-k", deployPath(t, "rbac/rollout"))
	token := strings.TrimSpace(kubectl(ctx, t, f.cp, "create", "token", "ip-masq-agent-rollout", "-n", "kube-system", "--duration=1h"))
	// In the control plane's namespace, where the API server's address is local.
	p := testutil.Start(ctx, t, "ip", "netns", "exec", f.cp.Netns, agentBin, "rollout", "--kubeconfig="+tokenKubeconfig(t, f.cp, token), "--waves="+testWaves,
		"--hold="+testHold.String(), "--deadline="+liveness.String(), "--metrics-address=")
	if _, err := p.WaitLine(liveness, "time="); err != nil {
		t.Fatal(err)
	}
}

// waveOrder is the fleet's nodes in the order the waves release them.
func (f *fleet) waveOrder() []string {
	var names []string
	for _, n := range f.nodes {
		names = append(names, n.name)
	}
	slices.SortFunc(names, func(a, b string) int { return int(rollout.NodeHash(a) - rollout.NodeHash(b)) })
	return names
}

// rolloutState is the IPMasqAgentConfig's rollout.
func (f *fleet) rolloutState(ctx context.Context, t *testing.T) kube.Rollout {
	t.Helper()
	o, err := dynamic.NewForConfigOrDie(f.cp.Config).Resource(kube.Configs.GVR()).Get(ctx, kube.DefaultConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ro, err := rollout.ObjectOf(o)
	if err != nil {
		t.Fatal(err)
	}
	if ro.Rollout == nil {
		return kube.Rollout{}
	}
	return *ro.Rollout
}

// waitRollout waits until the rollout of generation gen is in phase.
func (f *fleet) waitRollout(ctx context.Context, t *testing.T, gen int64, phase string) kube.Rollout {
	t.Helper()
	var r kube.Rollout
	eventually(t, fmt.Sprintf("the rollout of generation %d %s", gen, phase), liveness, func() bool {
		r = f.rolloutState(ctx, t)
		return r.Generation == gen && r.Phase == phase
	})
	return r
}

// waitRolloutWave waits until the rollout of generation gen has released wave.
func (f *fleet) waitRolloutWave(ctx context.Context, t *testing.T, gen int64, wave int) {
	t.Helper()
	eventually(t, fmt.Sprintf("wave %d of generation %d", wave, gen), liveness, func() bool {
		r := f.rolloutState(ctx, t)
		return r.Generation == gen && r.Phase == kube.RolloutProgressing && r.Wave == wave
	})
}

// waitVerdicts waits until the named nodes' datapaths give want.
func (f *fleet) waitVerdicts(ctx context.Context, t *testing.T, what string, names []string, want e2e.Want) {
	t.Helper()
	for _, n := range f.nodes {
		if !slices.Contains(names, n.name) {
			continue
		}
		eventually(t, fmt.Sprintf("%s: %s's verdict %v", what, n.name, want), liveness, func() bool {
			w, err := verdict(ctx, n)
			return err == nil && w == want
		})
	}
}
