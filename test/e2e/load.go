package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
)

// LoadTarget is where the NAT load goes: an address of the external host that the default
// policy masquerades, on ports where nothing listens.
var LoadTarget = netip.MustParseAddr("198.18.0.1")

// NATLoad is what MeasureNATLoad saw.
type NATLoad struct {
	Flows int
	// Entries is the NAT table's UDP entries once the flows were in (two per flow), Rounds how
	// many sends that took (datagrams the veths dropped are sent again), Fill how long.
	Entries, Rounds int
	Fill            time.Duration
	// FirstExpired is when, after the last round started, the first entry was gone; AllExpired
	// when, after the last round ended (at LastSent), the last one was, as the polls of the
	// agent's metrics saw it (their own time included).
	FirstExpired, AllExpired time.Duration
	LastSent                 time.Time
	// Swept is how many UDP entries the sweep counted as removed meanwhile.
	Swept float64
	// RSSIdle is the agent's resident memory before the load, RSSMax the most seen while the
	// table was full and swept (sampled at every poll, 10 per second).
	RSSIdle, RSSMax int64
}

func (l NATLoad) String() string {
	return fmt.Sprintf("%d flows: %d UDP entries after %d rounds in %v; first expired %v after the last round began, all %v after it ended; %v swept; agent RSS %d KiB idle, at most %d KiB under load",
		l.Flows, l.Entries, l.Rounds, l.Fill.Round(time.Millisecond), l.FirstExpired.Round(time.Millisecond),
		l.AllExpired.Round(time.Millisecond), l.Swept, l.RSSIdle/1024, l.RSSMax/1024)
}

// udpNAT reads the IPv4 UDP entries and the swept UDP entries from the agent's metrics.
func udpNAT(ctx context.Context, tb testing.TB, ag *Agent) (entries, swept float64) {
	tb.Helper()
	var m Metrics
	var err error
	for range 3 { // a scrape may time out on a busy machine
		if m, err = ag.Scrape(ctx); err == nil {
			break
		}
	}
	if err != nil {
		tb.Fatal(err)
	}
	for _, v := range m.Series("ip_masq_agent_nat_entries", Labels{"family": "ipv4", "protocol": "udp"}) {
		entries += v // every state
	}
	swept, _ = m.Value("ip_masq_agent_nat_swept_entries_total", Labels{"protocol": "udp"})
	return entries, swept
}

// MeasureNATLoad opens flows UDP flows from the pod (sockets pod sockets, see UDPFlows) through
// the BPF agent of env, which must run with --nat-timeouts=udp=udpTimeout, and follows the NAT
// table until the sweep has removed them all. It fails when the flows do not all get into the
// table within three rounds of sending, or the table does not empty within a minute.
func MeasureNATLoad(ctx context.Context, tb testing.TB, env *Env, flows, sockets int, udpTimeout time.Duration) NATLoad {
	tb.Helper()
	ag := env.Agent
	l := NATLoad{Flows: flows}
	var err error
	if l.RSSIdle, err = ag.RSS(); err != nil {
		tb.Fatal(err)
	}
	l.RSSMax = l.RSSIdle
	sample := func() {
		if rss, err := ag.RSS(); err == nil {
			l.RSSMax = max(l.RSSMax, rss)
		}
	}
	_, swept0 := udpNAT(ctx, tb, ag)
	start := time.Now()
	var round, sent time.Time
	for l.Rounds < 3 && l.Entries != 2*flows {
		l.Rounds++
		round = time.Now()
		if err := UDPFlows(ctx, env.Pod, LoadTarget, sockets, flows); err != nil {
			tb.Fatalf("open %d flows: %v", flows, err)
		}
		sent = time.Now()
		// The last datagrams may still be on their way through the node.
		_ = testutil.Poll(time.Second, 100*time.Millisecond, func() error {
			e, _ := udpNAT(ctx, tb, ag)
			sample()
			if l.Entries = int(e); l.Entries != 2*flows {
				return testutil.NotYet("%d UDP entries", 2*flows)
			}
			return nil
		})
	}
	l.Fill, l.LastSent = sent.Sub(start), sent
	if l.Entries != 2*flows {
		tb.Fatalf("%d UDP entries after %d rounds of %d flows, want %d", l.Entries, l.Rounds, flows, 2*flows)
	}
	if err := testutil.Poll(time.Minute, 100*time.Millisecond, func() error {
		e, swept := udpNAT(ctx, tb, ag)
		sample()
		if int(e) < 2*flows && l.FirstExpired == 0 {
			l.FirstExpired = time.Since(round)
		}
		if e > 0 {
			return testutil.NotYet("no UDP entry left after the flows ended (timeout %v), %v left", udpTimeout, e)
		}
		l.AllExpired, l.Swept = time.Since(sent), swept-swept0
		return nil
	}); err != nil {
		tb.Fatal(err)
	}
	return l
}

// NATSteady is what MeasureSteadyNAT saw.
type NATSteady struct {
	Flows, Entries int
	Window         time.Duration
	// CPUIdle is the agent's CPU time over Window before the flows, CPUFull over Window with
	// them in the table (none expiring): the difference is what the sweeps (and the drift
	// checks, which do not depend on the table) of a full table cost.
	CPUIdle, CPUFull time.Duration
	RSSIdle, RSSFull int64
}

func (s NATSteady) String() string {
	return fmt.Sprintf("%d flows (%d entries) held for %v: agent CPU %v (idle: %v), RSS %d KiB (idle: %d KiB)",
		s.Flows, s.Entries, s.Window, s.CPUFull, s.CPUIdle, s.RSSFull/1024, s.RSSIdle/1024)
}

// MeasureSteadyNAT measures the agent of env idle for window, then with flows UDP flows in the
// table for window, nothing scraping it meanwhile. The flows must outlive 2*window + the time
// to open them (the default UDP timeout of 2 minutes does for a window of 30 s).
func MeasureSteadyNAT(ctx context.Context, tb testing.TB, env *Env, flows, sockets int, window time.Duration) NATSteady {
	tb.Helper()
	ag := env.Agent
	s := NATSteady{Flows: flows, Window: window}
	measure := func() (time.Duration, int64) {
		tb.Helper()
		before, err := ag.CPUTime()
		if err != nil {
			tb.Fatal(err)
		}
		var rss int64
		for end := time.Now().Add(window); time.Now().Before(end); time.Sleep(time.Second) {
			r, err := ag.RSS()
			if err != nil {
				tb.Fatal(err)
			}
			rss = max(rss, r)
		}
		after, err := ag.CPUTime()
		if err != nil {
			tb.Fatal(err)
		}
		return after - before, rss
	}
	s.CPUIdle, s.RSSIdle = measure()
	if err := UDPFlows(ctx, env.Pod, LoadTarget, sockets, flows); err != nil {
		tb.Fatalf("open %d flows: %v", flows, err)
	}
	time.Sleep(time.Second)
	e, _ := udpNAT(ctx, tb, ag)
	s.Entries = int(e)
	s.CPUFull, s.RSSFull = measure()
	return s
}
