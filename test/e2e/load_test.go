package e2e

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// loadFlows is TestNATLoad's size; BenchmarkNATLoad in test/bench runs 100k (see docs/operations.md, Sizing the NAT table).
const loadFlows = 20_000

// TestNATLoad: 20k concurrent masqueraded UDP flows (40k NAT entries) through the BPF agent.
// No entry goes before its timeout; the sweep removes them all within the timeout and two sweep
// intervals of the last packet (by the agent's clock: the end of its sweep that removed the
// last flow), and counts each one; the agent's resident memory grows by no more than
// loadRSSGrowth while it reports and sweeps the full table (the table itself lives in the
// kernel; a sweep that copied it into the agent's heap would break the bound).
func TestNATLoad(t *testing.T) {
	const (
		sweepInterval = time.Second
		loadRSSGrowth = 8 << 20
	)
	// Scaled: the flows must all be in the table at once, and sending 20k of them took a
	// loaded TCG guest longer than 3 s, so that the first expired before the last was sent (5.10,
	// CI: 38681 entries after 3 rounds).
	udpTimeout := Scaled(3 * time.Second)
	b := BestBPFBackend()
	requireBackend(t, b)
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), ScenarioTimeout)
	defer cancel()
	env := NewBackendEnv(ctx, t, b, nil)
	// --v=4: each sweep that removes flows logs it (sweptAt).
	env.AgentFlags = append(env.AgentFlags, "--nat-sweep-interval="+sweepInterval.String(), "--nat-timeouts=udp="+udpTimeout.String(), "--v=4")
	ag := env.StartReadyNoFile(ctx, t, b)
	l := MeasureNATLoad(ctx, t, env, loadFlows, 1, udpTimeout)
	all := sweptAt(ctx, t, ag, l.Swept).Sub(l.LastSent)
	t.Logf("%v; the sweep removed the last flow %v after the last datagram", l, all.Round(time.Millisecond))
	if l.FirstExpired < udpTimeout {
		t.Errorf("an entry was gone %v after its flow's datagram was sent, before the UDP timeout of %v", l.FirstExpired, udpTimeout)
	}
	// The polls of the metrics only notice the table empty later, by the time their scrapes of
	// 40k entries take, which a loaded machine stretches to seconds (and times out): the bound
	// is on the agent's own account of its sweeps.
	if limit := udpTimeout + 2*sweepInterval + time.Second; all > limit {
		t.Errorf("the sweep removed the last flow %v after the last datagram, want at most %v (timeout, two sweeps, slack)", all, limit)
	}
	if l.Swept != float64(2*loadFlows) {
		t.Errorf("the sweep counted %v UDP entries removed, want %d", l.Swept, 2*loadFlows)
	}
	if growth := l.RSSMax - l.RSSIdle; growth > loadRSSGrowth {
		t.Errorf("the agent's memory grew by %d KiB under the load, more than %d KiB", growth/1024, loadRSSGrowth/1024)
	}
}

// sweepLineRE matches the debug line of a sweep that removed flows: how many, and how many
// halves without their partner.
var sweepLineRE = regexp.MustCompile(`msg="NAT sweep" .*\bflows=(\d+) orphanEntries=(\d+)`)

// sweptAt waits until the agent's sweeps have logged the removal of entries entries (the swept
// total its metrics count) and returns when the last of those sweeps logged it, right after it
// ended.
func sweptAt(ctx context.Context, t *testing.T, ag *Agent, entries float64) time.Time {
	t.Helper()
	lines := 0
	err := ag.poll(ctx, fmt.Sprintf("sweeps logging %v entries removed", entries), func() (bool, error) {
		removed := 0
		lines = 0
		for _, l := range strings.Split(ag.Logs(), "\n") {
			m := sweepLineRE.FindStringSubmatch(l)
			if m == nil {
				continue
			}
			flows, err1 := strconv.Atoi(m[1])
			orphans, err2 := strconv.Atoi(m[2])
			if err1 != nil || err2 != nil {
				return false, fmt.Errorf("sweep line %q", l)
			}
			removed += 2*flows + orphans
			lines++
		}
		return float64(removed) >= entries, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	at, err := ag.LogTime(lines, `msg="NAT sweep"`, " flows=")
	if err != nil {
		t.Fatal(err)
	}
	return at
}
