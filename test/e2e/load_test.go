package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
)

// loadFlows is TestNATLoad's size; BenchmarkNATLoad in test/bench runs 100k (see the README).
const loadFlows = 20_000

// TestNATLoad: 20k concurrent masqueraded UDP flows (40k NAT entries) through the BPF agent.
// No entry goes before its timeout; the sweep removes them all within the timeout and two sweep
// intervals of the last packet, and counts each one; the agent's resident memory grows by no
// more than loadRSSGrowth while it reports and sweeps the full table (the table itself lives in
// the kernel; a sweep that copied it into the agent's heap would break the bound).
func TestNATLoad(t *testing.T) {
	const (
		udpTimeout    = 3 * time.Second
		sweepInterval = time.Second
		loadRSSGrowth = 8 << 20
	)
	b := BPFBackend(tc.ModeTCX)
	requireBackend(t, b)
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	defer cancel()
	env := NewBackendEnv(ctx, t, b, nil)
	env.AgentFlags = append(env.AgentFlags, "--nat-sweep-interval="+sweepInterval.String(), "--nat-timeouts=udp="+udpTimeout.String())
	env.StartReadyNoFile(ctx, t, b)
	l := MeasureNATLoad(ctx, t, env, loadFlows, 1, udpTimeout)
	t.Log(l)
	if l.FirstExpired < udpTimeout {
		t.Errorf("an entry was gone %v after its flow's datagram was sent, before the UDP timeout of %v", l.FirstExpired, udpTimeout)
	}
	if limit := udpTimeout + 2*sweepInterval + time.Second; l.AllExpired > limit {
		t.Errorf("the last entry was gone %v after the last datagram, want at most %v (timeout, two sweeps, slack)", l.AllExpired, limit)
	}
	if l.Swept != float64(2*loadFlows) {
		t.Errorf("the sweep counted %v UDP entries removed, want %d", l.Swept, 2*loadFlows)
	}
	if growth := l.RSSMax - l.RSSIdle; growth > loadRSSGrowth {
		t.Errorf("the agent's memory grew by %d KiB under the load, more than %d KiB", growth/1024, loadRSSGrowth/1024)
	}
}
