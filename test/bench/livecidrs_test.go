package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/test/bench/benchdata"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

var (
	liveCIDRs = flag.Int("live-cidrs", 100_000, "CIDRs of BenchmarkLiveCIDRs' configs")
	liveRuns  = flag.Int("live-runs", 3, "swaps BenchmarkLiveCIDRs times each way, per backend and kind")
	liveEdit  = flag.Int("live-changed", 10, "CIDRs the edits of BenchmarkLiveCIDRs change")
)

// probeEvery is how often a swap's probe opens a new flow, and probeSlowEvery how often once
// the swap has taken probeSlowAfter: each probe takes a source port of its own, and a swap of
// iptables' 100k rules takes tens of seconds, which at one a millisecond would run the pod out
// of ports; for a swap that long 10 ms are a resolution of 1% at most.
const (
	probeEvery     = time.Millisecond
	probeSlowAfter = time.Second
	probeSlowEvery = 10 * time.Millisecond
)

// BenchmarkLiveCIDRs: a config of -live-cidrs non-masquerade CIDRs replaced by another of as many
// (a ConfigMap's ..data swap), which changes the verdict of one destination, timed to the first
// new flow that gets the new verdict: a pod opens a new UDP flow to the external host every
// millisecond and the host's echo says which source it saw (the node's address: masqueraded;
// the pod's: not). Two kinds of swap: a whole new set, and an edit that changes -live-changed
// of the CIDRs (the target's among them). The swaps go both ways, -live-runs times each, on
// every backend with default flags, on a datapath already sized for that many CIDRs. Results
// go to livecidrs.json in -out.
//
//	go test -run '^$' -bench LiveCIDRs -benchtime 1x ./test/bench -args -out DIR
func BenchmarkLiveCIDRs(b *testing.B) {
	testutil.RequirePrivileged(b, "ip", "iptables-nft-restore", "nft")
	bins := buildBinaries(b)
	for range b.N {
		var all []benchdata.LiveCIDRs
		for _, m := range modes() {
			if m.Backend == nil || len(m.Flags) > 0 {
				continue
			}
			for _, changed := range []int{*liveCIDRs, min(*liveEdit, *liveCIDRs)} {
				b.Run(fmt.Sprintf("%s/changed=%d", m.Name, changed), func(b *testing.B) {
					res := measureLiveCIDRs(b, bins, m, *liveCIDRs, changed)
					b.ReportMetric(median(res.Verdict)*1000, "verdict-ms")
					all = append(all, res)
				})
			}
		}
		writeJSON(b, benchdata.LiveCIDRsFile, all)
	}
}

// swapTarget is the destination whose verdict the swaps change: the external host's, outside
// every CIDR of cidrConfigFrom; liveConfig's of the odd swaps hold its /32.
var swapTarget = target

// liveConfig is the i-th config of the swaps: n CIDRs, the first n-changed the same in every
// config and the last changed ones its own, the target's /32 in place of the last of those (so
// that its flows keep the pod's address) when i is odd.
func liveConfig(n, changed, i int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "cidrLimit: %d\nnonMasqueradeCIDRs:\n", n)
	kept, own := n-changed, n-changed+i*changed // own: the first /24 of this config's own
	for j := range n {
		switch {
		case i%2 == 1 && j == n-1:
			fmt.Fprintf(&b, "  - %s/32\n", swapTarget)
		case j < kept:
			fmt.Fprintf(&b, "  - %s\n", cidr24(j))
		default:
			fmt.Fprintf(&b, "  - %s\n", cidr24(own+j-kept))
		}
	}
	return b.String()
}

func measureLiveCIDRs(b *testing.B, bins binaries, m Mode, n, changed int) benchdata.LiveCIDRs {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	env := newEnv(ctx, b, bins, 0)
	e2e.StartLineEchoUDP(b, env.Ext, []netip.Addr{swapTarget})
	if err := env.Config.Write(liveConfig(n, changed, 0)); err != nil {
		b.Fatal(err)
	}
	startMode(ctx, b, env, m, map[string]bool{})
	res := benchdata.LiveCIDRs{Mode: m.Name, CIDRs: n, Changed: changed}
	p := &probes{}
	// The agent started with the first config: the first probe sees it masqueraded.
	if _, err := verdictAfter(ctx, env, p, e2e.NodeAddr4, time.Now()); err != nil {
		b.Fatal(err)
	}
	for i := 1; i <= 2**liveRuns; i++ {
		want := e2e.NodeAddr4
		if i%2 == 1 {
			want = e2e.PodAddr4
		}
		applied := env.Agent.Count("policy applied")
		if err := env.Config.Write(liveConfig(n, changed, i)); err != nil {
			b.Fatal(err)
		}
		start := env.Config.Swapped // the agent may be done before Write returns
		sent, err := verdictAfter(ctx, env, p, want, start)
		if err != nil {
			b.Fatalf("swap %d: %v\n%s", i, err, env.Agent.Logs())
		}
		took := time.Since(start)
		res.Probes += sent
		if err := env.Agent.WaitLog(ctx, applied+1, "policy applied"); err != nil {
			b.Fatalf("swap %d: %v", i, err)
		}
		at, err := env.Agent.LogTime(applied+1, "policy applied")
		if err != nil {
			b.Fatal(err)
		}
		res.Verdict = append(res.Verdict, took.Seconds())
		res.Applied = append(res.Applied, at.Sub(start).Seconds())
		b.Logf("%s: swap %d of %d of %d CIDRs: the new verdict after %v (applied after %v, %d probes)",
			m.Name, i, changed, n, took.Round(time.Millisecond), at.Sub(start).Round(time.Millisecond), sent)
	}
	return res
}

// verdictAfter opens a new UDP flow from the pod to the target every probeEvery (then every
// probeSlowEvery) until the target sees one from want, and returns how many it opened. Each flow is one datagram and its
// answer, from a source port no probe used before (p.next): a new flow, which the new policy
// judges, where a port used again could meet an earlier flow's mapping (an old flow keeps it,
// as conntrack's do) and show its verdict.
func verdictAfter(ctx context.Context, env *e2e.Env, p *probes, want netip.Addr, since time.Time) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	next := since
	for n := 1; ; n++ {
		every := probeEvery
		if time.Since(since) >= probeSlowAfter {
			every = probeSlowEvery
		}
		// On from the schedule, or from now when a probe took longer than its turn.
		if now := time.Now(); next.Before(now) {
			next = now
		}
		next = next.Add(every)
		src, err := p.probe(ctx, env.Pod)
		if err != nil {
			return n, err
		}
		if src == want {
			return n, nil
		}
		if err := ctx.Err(); err != nil {
			return n, fmt.Errorf("no flow from %s after %d probes (the last from %s): %w", want, n, src, err)
		}
		time.Sleep(time.Until(next))
	}
}

// probes are the probes of one topology: each from the next source port.
type probes struct{ port uint16 }

// probe sends one datagram from a new socket of the pod, on a port of its own, to the target's
// echo and returns the source address the target saw.
func (p *probes) probe(ctx context.Context, pod string) (netip.Addr, error) {
	if p.port == 0 {
		p.port = 10000
	}
	if p.port == 65535 {
		return netip.Addr{}, errors.New("out of source ports for new flows")
	}
	p.port++
	c, err := e2e.DialLineUDP(ctx, pod, netip.AddrPortFrom(e2e.PodAddr4, p.port), swapTarget)
	if err != nil {
		return netip.Addr{}, err
	}
	defer c.Close()
	src, err := c.Exchange("probe")
	return src.Addr(), err
}
