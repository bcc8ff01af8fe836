package iptables_test

import (
	"context"
	"log/slog"
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
