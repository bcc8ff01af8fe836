package iptables_test

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/test/e2e"
)

const seedNodeIdentity = `nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 100.64.230.0/24, 192.168.0.0/16, fc00::/7]
masqOutBound: true
masqOutBoundIPv6: true
`

// readChain reads the chain and the POSTROUTING jumps back from the kernel.
func readChain(ctx context.Context, t *testing.T, ns string, mode iptables.Mode, fam policy.Family) (chain, jumps []string) {
	t.Helper()
	tool := "iptables-" + string(mode) + "-save"
	if fam == policy.IPv6 {
		tool = "ip6" + tool[2:]
	}
	out, err := e2e.NSExec(ctx, ns, "", tool)
	if err != nil {
		t.Fatal(err)
	}
	nat, err := iptables.ParseSave(out, "nat")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range nat.ChainRules(iptables.DefaultChain) {
		chain = append(chain, r.Text())
	}
	for _, r := range nat.RulesTargeting(iptables.DefaultChain) {
		jumps = append(jumps, r.Text())
	}
	return chain, jumps
}

func wantLines(p *policy.Policy, fam policy.Family) []string {
	var out []string
	for _, l := range iptables.ChainLines(p, fam, iptables.DefaultChain) {
		out = append(out, l.Rule.String())
	}
	return out
}

// The backend against the real kernel, in a node namespace that uses each mode: mode detection,
// apply (idempotent, jump once), counters of real traffic mapped to the right rules, removal of
// a stale IPv6 chain, and cleanup twice.
func TestBackendInKernel(t *testing.T) {
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			testutil.RequirePrivileged(t, "ip", "iptables-"+string(mode)+"-restore", "ip6tables-"+string(mode)+"-restore")
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			env := &e2e.Env{Topology: e2e.NewTopology(ctx, t)}
			e2e.IptablesBackend(mode).Prepare(ctx, t, env)
			runner := iptables.ExecRunner{Prefix: []string{"ip", "netns", "exec", env.Node}}
			b, err := iptables.New(ctx, iptables.Options{Runner: runner})
			if err != nil {
				t.Fatal(err)
			}
			if b.Mode() != mode {
				t.Fatalf("detected %s on a %s node", b.Mode(), mode)
			}
			cfg, err := config.Parse([]byte(seedNodeIdentity), config.Options{EnableIPv6: true})
			if err != nil {
				t.Fatal(err)
			}
			p := policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true})
			for range 2 {
				if err := b.Apply(ctx, p); err != nil {
					t.Fatal(err)
				}
			}
			for _, fam := range policy.Families() {
				chain, jumps := readChain(ctx, t, env.Node, mode, fam)
				if want := wantLines(p, fam); !slices.Equal(chain, want) {
					t.Errorf("%s chain read back:\n %q\nwant\n %q", fam, chain, want)
				}
				if want := []string{iptables.JumpRule(iptables.DefaultChain).String()}; !slices.Equal(jumps, want) {
					t.Errorf("%s jumps %q, want exactly %q", fam, jumps, want)
				}
			}
			// The drift check's `iptables -S` listing reads as the rendered lines do.
			if drift, err := b.CheckDrift(ctx); err != nil || len(drift) != 0 {
				t.Errorf("drift check right after the apply: %q %v", drift, err)
			}
			if _, err := e2e.NSExec(ctx, env.Node, "", "ip6tables-"+string(mode), "-t", "nat", "-F", iptables.DefaultChain); err != nil {
				t.Fatal(err)
			}
			if drift, err := b.CheckDrift(ctx); err != nil || !slices.Equal(drift, []string{datapath.DriftChain}) {
				t.Errorf("drift check after the IPv6 chain was flushed: %q %v", drift, err)
			}
			if err := b.Apply(ctx, p); err != nil {
				t.Fatal(err)
			}

			// Real traffic: each new flow passes the nat chain once, at its first packet.
			probes := map[string]int{"10.1.2.3": 2, "8.8.8.8": 3, "2001:4860:4860::8888": 1}
			for dst, n := range probes {
				for range n {
					if _, _, err := env.Observe(ctx, "tcp", netip.MustParseAddr(dst)); err != nil {
						t.Fatal(err)
					}
				}
			}
			counters, err := b.Counters(ctx)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("counters: %+v", counters)
			if len(counters) != len(p.IPv4)+len(p.IPv6) {
				t.Fatalf("%d counters for %d rules: %+v", len(counters), len(p.IPv4)+len(p.IPv6), counters)
			}
			for _, c := range counters {
				var want uint64
				exact := true
				switch {
				case c.Family == policy.IPv4 && c.Prefix == netip.MustParsePrefix("10.0.0.0/8"):
					want = 2
				case c.Family == policy.IPv4 && c.Action == policy.Masquerade:
					want = 3
				case c.Family == policy.IPv6 && c.Action == policy.Masquerade:
					want = 1
				case c.Family == policy.IPv6 && c.Prefix == policy.LinkLocalIPv6:
					// The node's own neighbour discovery may pass here.
					exact = false
				}
				if exact && c.Packets != want || c.Packets < want {
					t.Errorf("rule %s #%d %s %s: %d packets, want %d", c.Family, c.Rule, c.Prefix, c.Action, c.Packets, want)
				}
				if c.Packets > 0 && c.Bytes < 40*c.Packets {
					t.Errorf("rule %s #%d: %d bytes for %d packets", c.Family, c.Rule, c.Bytes, c.Packets)
				}
			}

			// A later run without IPv6 removes the IPv6 chain it no longer manages.
			b2, err := iptables.New(ctx, iptables.Options{Runner: runner})
			if err != nil {
				t.Fatal(err)
			}
			v4cfg, err := config.Parse([]byte("nonMasqueradeCIDRs: [10.0.0.0/8]\n"), config.Options{})
			if err != nil {
				t.Fatal(err)
			}
			v4 := policy.Compile(v4cfg, policy.Options{RandomFully: true})
			if err := b2.Apply(ctx, v4); err != nil {
				t.Fatal(err)
			}
			if chain, jumps := readChain(ctx, t, env.Node, mode, policy.IPv6); len(chain)+len(jumps) != 0 {
				t.Errorf("stale IPv6 chain left: %q %q", chain, jumps)
			}
			if chain, _ := readChain(ctx, t, env.Node, mode, policy.IPv4); !slices.Equal(chain, wantLines(v4, policy.IPv4)) {
				t.Errorf("IPv4 chain after the IPv4-only apply: %q", chain)
			}

			for i := range 2 {
				if err := b2.Cleanup(ctx); err != nil {
					t.Fatalf("cleanup #%d: %v", i+1, err)
				}
				for _, m := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
					for _, fam := range policy.Families() {
						if chain, jumps := readChain(ctx, t, env.Node, m, fam); len(chain)+len(jumps) != 0 {
							t.Errorf("cleanup #%d left %s %s: %q %q", i+1, m, fam, chain, jumps)
						}
					}
				}
			}
			if c, err := b2.Counters(ctx); err != nil || c != nil {
				t.Errorf("counters after cleanup: %v %v", c, err)
			}
		})
	}
}

// The real iptables-legacy without a lock file it can open (XTABLES_LOCKFILE names one in a
// directory that does not exist, as /run/xtables.lock is in a read-only container without the
// node's lock mounted): the apply fails naming the lock and the fix, and nothing is taken for a
// kernel that rejects --random-fully.
func TestBackendWithoutXtablesLock(t *testing.T) {
	testutil.RequirePrivileged(t, "ip", "env", "iptables-legacy-restore")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ns := testutil.NewNetns(t)
	lock := filepath.Join(t.TempDir(), "missing", "xtables.lock")
	runner := iptables.ExecRunner{Prefix: []string{"env", "XTABLES_LOCKFILE=" + lock, "ip", "netns", "exec", ns}}
	var logs strings.Builder
	b, err := iptables.New(ctx, iptables.Options{Runner: runner, Mode: iptables.ModeLegacy, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse([]byte("nonMasqueradeCIDRs: [10.0.0.0/8]\n"), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	err = b.Apply(ctx, policy.Compile(cfg, policy.Options{RandomFully: true}))
	if err == nil {
		t.Fatal("apply succeeded without a lock file")
	}
	for _, want := range []string{"can't open lock file " + lock, "mount the node's /run/xtables.lock"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if strings.Contains(logs.String(), "rejects") {
		t.Errorf("the lock failure was taken for a rejection of --random-fully:\n%s", logs.String())
	}
}

// SNAT rules (a policy with masquerade addresses, with and without --to-ports) as the real
// tools store them: the chain reads back as rendered in both modes and families, so the drift
// check finds nothing and every rule keeps its counters through a re-apply.
func TestSNATInKernel(t *testing.T) {
	cfg, err := config.Parse([]byte(`masqueradeAddress: 192.0.2.11
masqueradeAddressIPv6: "2001:db8::11"
masqueradeCIDRs:
  - {cidr: 10.10.10.10/32, address: 192.0.2.12}
  - {cidr: "2001:db8:1::/48", address: "2001:db8::12"}
  - 10.20.0.0/16
`), config.Options{EnableIPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		for _, ports := range []string{"", "40000-40099,50000-50099"} {
			t.Run(string(mode)+"/to-ports="+ports, func(t *testing.T) {
				testutil.RequirePrivileged(t, "ip", "iptables-"+string(mode)+"-restore", "ip6tables-"+string(mode)+"-restore")
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				ns := testutil.NewNetns(t)
				b, err := iptables.New(ctx, iptables.Options{Mode: mode, Runner: iptables.ExecRunner{Prefix: []string{"ip", "netns", "exec", ns}}})
				if err != nil {
					t.Fatal(err)
				}
				toPorts, err := policy.ParsePortRanges(ports)
				if err != nil {
					t.Fatal(err)
				}
				p := policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true, ToPorts: toPorts})
				if err := b.Apply(ctx, p); err != nil {
					t.Fatal(err)
				}
				for _, fam := range policy.Families() {
					chain, _ := readChain(ctx, t, ns, mode, fam)
					if want := wantLines(p, fam); !slices.Equal(chain, want) {
						t.Errorf("%s chain read back:\n %q\nwant\n %q", fam, chain, want)
					}
					if !strings.Contains(strings.Join(chain, "\n"), "-j SNAT --to-source ") {
						t.Errorf("%s chain has no SNAT rule: %q", fam, chain)
					}
				}
				if drift, err := b.CheckDrift(ctx); err != nil || len(drift) != 0 {
					t.Errorf("drift check right after the apply: %q %v", drift, err)
				}
				counters, err := b.Counters(ctx)
				if err != nil || len(counters) != len(p.IPv4)+len(p.IPv6) {
					t.Errorf("%d counters for %d rules (%v): %+v", len(counters), len(p.IPv4)+len(p.IPv6), err, counters)
				}
				for _, c := range counters {
					if c.Rule == 0 {
						t.Errorf("an installed line the policy does not explain: %+v", c)
					}
				}
				// dump reads each masquerade rule's address from its lines (--to-source): for the
				// rules of the policy it is given, and for lines of no rule without one.
				for _, given := range []*policy.Policy{p, nil} {
					found, err := iptables.Inspect(ctx, iptables.ExecRunner{Prefix: []string{"ip", "netns", "exec", ns}}, iptables.DefaultChain, given)
					if err != nil || len(found) != 1 || found[0].Mode() != mode {
						t.Fatalf("inspect: %d installations (%v), want the %s one", len(found), err, mode)
					}
					dumped, err := found[0].Counters(ctx)
					if err != nil {
						t.Fatal(err)
					}
					addressed := 0
					for _, c := range dumped {
						if want := ruleAddress(p, c); c.Address != want {
							t.Errorf("dump (policy given: %v): %s rule %d %s %s to %v, want %v", given != nil, c.Family, c.Rule, c.Action, c.Prefix, c.Address, want)
						}
						if c.Address.IsValid() {
							addressed++
						}
					}
					if addressed == 0 {
						t.Errorf("dump (policy given: %v): no rule with an address: %+v", given != nil, dumped)
					}
				}
			})
		}
	}
}

// ruleAddress is the masquerade address of the rule of p that counter c is: by its number, or
// for a line of no rule, the first rule of its family with its prefix and action.
func ruleAddress(p *policy.Policy, c datapath.RuleCounter) netip.Addr {
	rules := p.Rules(c.Family)
	if c.Rule > 0 {
		return rules[c.Rule-1].Address
	}
	for _, r := range rules {
		if r.Prefix == c.Prefix && r.Action == c.Action {
			return r.Address
		}
	}
	return netip.Addr{}
}

// readOurChains reads every chain of the nat table that is the main chain or one of its source
// rules' chains (by name), with its rules, from the kernel.
func readOurChains(ctx context.Context, t *testing.T, ns string, mode iptables.Mode, fam policy.Family) map[string][]string {
	t.Helper()
	tool := "iptables-" + string(mode) + "-save"
	if fam == policy.IPv6 {
		tool = "ip6" + tool[2:]
	}
	out, err := e2e.NSExec(ctx, ns, "", tool)
	if err != nil {
		t.Fatal(err)
	}
	nat, err := iptables.ParseSave(out, "nat")
	if err != nil {
		t.Fatal(err)
	}
	chains := map[string][]string{}
	for _, c := range nat.Chains {
		if c == iptables.DefaultChain || strings.HasPrefix(c, iptables.DefaultChain+"-") {
			chains[c] = []string{}
			for _, r := range nat.ChainRules(c) {
				chains[c] = append(chains[c], r.Text())
			}
		}
	}
	return chains
}

// layoutTexts is what readOurChains should find for a policy.
func layoutTexts(p *policy.Policy, fam policy.Family) map[string][]string {
	chains := map[string][]string{}
	for _, c := range iptables.Layout(p, fam, iptables.DefaultChain) {
		chains[c.Name] = []string{}
		for _, l := range c.Lines {
			chains[c.Name] = append(chains[c.Name], l.Rule.String())
		}
	}
	return chains
}

// Source rules against the real kernel and tools: three pod addresses to the same
// destinations, decided by the global lists, by a rule that masquerades everything to the
// node's second address, and by one that keeps every source (its end must not fall back to the
// global outbound rule); counters per rule; rules added and removed across applies, each
// apply's chains read back as rendered; and cleanup.
func TestSourceRulesInKernel(t *testing.T) {
	const first = `nonMasqueradeCIDRs: [10.0.0.0/8]
masqOutBound: true
masqOutBoundIPv6: true
sourceRules:
  - name: batch
    cidrs: [10.244.1.3/32, "fd00:10:244:1::3/128"]
    masqueradeAddress: 10.99.0.11
    masqueradeAddressIPv6: "2001:db8:99::11"
    nonMasqueradeCIDRs: []
  - name: keep
    cidrs: [10.244.1.4/32]
    masqOutBound: false
`
	// keep goes; fresh masquerades its source (keep's) to the second address; batch stays.
	const second = `nonMasqueradeCIDRs: [10.0.0.0/8]
masqOutBound: true
masqOutBoundIPv6: true
sourceRules:
  - name: fresh
    cidrs: [10.244.1.4/32]
    masqueradeAddress: 10.99.0.11
  - name: batch
    cidrs: [10.244.1.3/32, "fd00:10:244:1::3/128"]
    masqueradeAddress: 10.99.0.11
    masqueradeAddressIPv6: "2001:db8:99::11"
    nonMasqueradeCIDRs: []
`
	const none = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqOutBound: true\nmasqOutBoundIPv6: true\n"
	var (
		global  = e2e.PodAddr4
		batch   = netip.MustParseAddr("10.244.1.3")
		keep    = netip.MustParseAddr("10.244.1.4")
		batch6  = netip.MustParseAddr("fd00:10:244:1::3")
		local   = netip.MustParseAddr("10.1.2.3")
		public  = netip.MustParseAddr("8.8.8.8")
		public6 = netip.MustParseAddr("2001:4860:4860::8888")
	)
	compile := func(t *testing.T, doc string) *policy.Policy {
		t.Helper()
		cfg, err := config.Parse([]byte(doc), config.Options{EnableIPv6: true})
		if err != nil {
			t.Fatal(err)
		}
		return policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true})
	}
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			testutil.RequirePrivileged(t, "ip", "iptables-"+string(mode)+"-restore", "ip6tables-"+string(mode)+"-restore")
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			env := &e2e.Env{Topology: e2e.NewTopology(ctx, t)}
			if err := env.AddAltAddresses(ctx); err != nil {
				t.Fatal(err)
			}
			if err := testutil.IPBatch(ctx, env.Pod, fmt.Sprintf("addr add %s/24 dev eth0\naddr add %s/24 dev eth0\naddr add %s/64 dev eth0 nodad\n", batch, keep, batch6)); err != nil {
				t.Fatal(err)
			}
			runner := iptables.ExecRunner{Prefix: []string{"ip", "netns", "exec", env.Node}}
			b, err := iptables.New(ctx, iptables.Options{Mode: mode, Runner: runner})
			if err != nil {
				t.Fatal(err)
			}
			// apply installs a policy and checks that the kernel holds exactly its chains.
			apply := func(t *testing.T, p *policy.Policy) {
				t.Helper()
				if err := b.Apply(ctx, p); err != nil {
					t.Fatal(err)
				}
				for _, fam := range policy.Families() {
					if got, want := readOurChains(ctx, t, env.Node, mode, fam), layoutTexts(p, fam); !maps.EqualFunc(got, want, slices.Equal) {
						t.Errorf("%s chains read back:\n %q\nwant\n %q", fam, got, want)
					}
				}
				if drift, err := b.CheckDrift(ctx); err != nil || len(drift) != 0 {
					t.Errorf("drift check right after the apply: %q %v", drift, err)
				}
			}
			// expect probes each destination from each source over TCP and checks the source
			// address the external host saw.
			expect := func(t *testing.T, cases []struct{ src, dst, seen netip.Addr }) {
				t.Helper()
				for _, c := range cases {
					got, err := env.ProbeFrom(ctx, env.Pod, c.src, "tcp", c.dst)
					if err != nil {
						t.Fatal(err)
					}
					if got.Addr() != c.seen {
						t.Errorf("%s -> %s: seen from %s, want %s", c.src, c.dst, got.Addr(), c.seen)
					}
				}
			}

			p1 := compile(t, first)
			apply(t, p1)
			// The same destinations, three sources, three outcomes.
			expect(t, []struct{ src, dst, seen netip.Addr }{
				{global, local, global}, {batch, local, e2e.NodeAlt4}, {keep, local, keep},
				{global, public, e2e.NodeAddr4}, {batch, public, e2e.NodeAlt4}, {keep, public, keep},
				{e2e.PodAddr6, public6, e2e.NodeAddr6}, {batch6, public6, e2e.NodeAlt6},
			})
			counters, err := b.Counters(ctx)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("counters: %+v", counters)
			// counted is the packets of the rule of a list (source rule name, "" the global one)
			// with a family, prefix and origin.
			counted := func(cs []datapath.RuleCounter, set string, fam policy.Family, prefix string, origin policy.Origin) (uint64, bool) {
				for _, c := range cs {
					if c.Set == set && c.Family == fam && c.Prefix == netip.MustParsePrefix(prefix) && c.Origin == origin {
						return c.Packets, true
					}
				}
				return 0, false
			}
			for _, w := range []struct {
				set    string
				fam    policy.Family
				prefix string
				origin policy.Origin
				want   uint64
			}{
				{"", policy.IPv4, "10.0.0.0/8", policy.OriginNonMasqueradeCIDRs, 1},
				{"", policy.IPv4, "0.0.0.0/0", policy.OriginOutbound, 1},
				{"batch", policy.IPv4, "0.0.0.0/0", policy.OriginOutbound, 2},
				{"keep", policy.IPv4, "10.0.0.0/8", policy.OriginNonMasqueradeCIDRs, 1},
				{"", policy.IPv6, "::/0", policy.OriginOutbound, 1},
				{"batch", policy.IPv6, "::/0", policy.OriginOutbound, 1},
			} {
				if got, ok := counted(counters, w.set, w.fam, w.prefix, w.origin); !ok || got != w.want {
					t.Errorf("list %q %s %s %s: %d packets (reported: %v), want %d", w.set, w.fam, w.prefix, w.origin, got, ok, w.want)
				}
			}
			if _, ok := counted(counters, "keep", policy.IPv4, "0.0.0.0/0", policy.OriginOutbound); ok {
				t.Errorf("keep has no outbound rule, yet it is counted")
			}

			// Rules added and removed: keep's chain goes, fresh's comes, batch keeps its counts.
			p2 := compile(t, second)
			apply(t, p2)
			expect(t, []struct{ src, dst, seen netip.Addr }{
				{keep, public, e2e.NodeAlt4}, {keep, local, keep}, {batch, local, e2e.NodeAlt4}, {global, public, e2e.NodeAddr4},
			})
			counters, err = b.Counters(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if got, _ := counted(counters, "batch", policy.IPv4, "0.0.0.0/0", policy.OriginOutbound); got != 3 {
				t.Errorf("batch's outbound rule counted %d packets through the reload and one more, want 3", got)
			}
			if got, _ := counted(counters, "fresh", policy.IPv4, "0.0.0.0/0", policy.OriginOutbound); got != 1 {
				t.Errorf("fresh's outbound rule counted %d packets, want 1", got)
			}
			for _, c := range counters {
				if c.Set == "keep" {
					t.Errorf("a counter of the removed rule: %+v", c)
				}
			}

			// No source rules: every source decided by the global lists again.
			apply(t, compile(t, none))
			expect(t, []struct{ src, dst, seen netip.Addr }{
				{batch, public, e2e.NodeAddr4}, {keep, public, e2e.NodeAddr4}, {batch6, public6, e2e.NodeAddr6},
			})

			// Cleanup, by a backend that knows no rule, removes the source chains too.
			apply(t, p1)
			b2, err := iptables.New(ctx, iptables.Options{Mode: mode, Runner: runner})
			if err != nil {
				t.Fatal(err)
			}
			if err := b2.Cleanup(ctx); err != nil {
				t.Fatal(err)
			}
			for _, fam := range policy.Families() {
				if got := readOurChains(ctx, t, env.Node, mode, fam); len(got) != 0 {
					t.Errorf("%s: cleanup left %q", fam, got)
				}
			}
		})
	}
}
