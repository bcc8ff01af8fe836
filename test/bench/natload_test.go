package bench

import (
	"context"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/tc"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

// BenchmarkNATLoad is e2e.TestNATLoad at full size, 100k concurrent masqueraded UDP flows
// (200k NAT entries) through the BPF agent (tcx). The flows are one datagram each, never
// answered, so they live in the table of unreplied flows: --nat-max-entries=524288 gives it
// 262,144 entries.
//
//   - steady: the agent's CPU and memory over 30 s idle, then over 30 s with the flows in the
//     table and nothing expiring (three sweeps at the default interval, 10 s);
//   - expiry: with --nat-timeouts=udp=10s, how soon the flows are in and all swept, the
//     agent's memory meanwhile (scraped 10 times a second), then 150k flows, more than the
//     table holds, which the LRU bounds.
//
// Run it alone (as root): go test -run '^$' -bench NATLoad -benchtime 1x ./test/bench
func BenchmarkNATLoad(b *testing.B) {
	const (
		flows, sockets = 100_000, 2
		udpTimeout     = 10 * time.Second
		overfill       = 150_000
		tableSize      = 1 << 18 // the unreplied table at --nat-max-entries=524288
	)
	testutil.RequirePrivileged(b, "ip")
	bins := buildBinaries(b)
	start := func(ctx context.Context, b *testing.B, flags ...string) *e2e.Env {
		b.Helper()
		env := e2e.NewEnv(ctx, b, bins.agent, nil)
		be := e2e.BPFBackend(tc.ModeTCX)
		be.Prepare(ctx, b, env)
		env.AgentFlags = append(env.AgentFlags, "--nat-max-entries=524288")
		env.AgentFlags = append(env.AgentFlags, flags...)
		env.SetGood("", true)
		if err := env.StartAgent(ctx, b, be).WaitReady(ctx); err != nil {
			b.Fatal(err)
		}
		time.Sleep(2 * time.Second) // past start-up allocations
		return env
	}
	b.Run("steady", func(b *testing.B) {
		for range b.N {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			s := e2e.MeasureSteadyNAT(ctx, b, start(ctx, b), flows, sockets, 30*time.Second)
			cancel()
			b.Log(s)
			if s.Entries != 2*flows {
				b.Errorf("%d entries for %d flows", s.Entries, flows)
			}
			b.ReportMetric(s.CPUIdle.Seconds(), "cpu-idle-s")
			b.ReportMetric(s.CPUFull.Seconds(), "cpu-full-s")
			b.ReportMetric(float64(s.RSSIdle)/(1<<20), "rss-idle-MiB")
			b.ReportMetric(float64(s.RSSFull)/(1<<20), "rss-full-MiB")
		}
	})
	b.Run("expiry", func(b *testing.B) {
		for range b.N {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			env := start(ctx, b, "--nat-timeouts=udp="+udpTimeout.String())
			l := e2e.MeasureNATLoad(ctx, b, env, flows, sockets, udpTimeout)
			b.Log(l)
			b.ReportMetric(l.Fill.Seconds(), "fill-s")
			b.ReportMetric(l.AllExpired.Seconds(), "swept-after-s")
			b.ReportMetric(float64(l.RSSMax)/(1<<20), "rss-max-MiB")

			// More flows than the table holds: the LRU evicts, the table stays at its size.
			if err := e2e.UDPFlows(ctx, env.Pod, e2e.LoadTarget, 3, overfill); err != nil {
				b.Fatal(err)
			}
			time.Sleep(time.Second)
			m, err := env.Agent.Scrape(ctx)
			if err != nil {
				b.Fatal(err)
			}
			entries := 0.0
			for _, v := range m.Series("ip_masq_agent_nat_entries", e2e.Labels{"family": "ipv4"}) {
				entries += v
			}
			rss, err := env.Agent.RSS()
			if err != nil {
				b.Fatal(err)
			}
			cancel()
			b.Logf("%d flows (%d entries) into a table of %d: %v entries, agent RSS %d KiB", overfill, 2*overfill, tableSize, entries, rss/1024)
			if entries > tableSize {
				b.Errorf("the table holds %v entries, more than its %d", entries, tableSize)
			}
			b.ReportMetric(entries, "lru-entries")
		}
	})
}
