package iptables_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables/iptablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

func TestParseListedRule(t *testing.T) {
	for _, c := range []struct {
		line, spec     string
		packets, bytes uint64
	}{
		{`-A C -d 10.0.0.0/8 -m comment --comment "x -c 1 2" -c 5 600 -j RETURN`, `-d 10.0.0.0/8 -m comment --comment "x -c 1 2" -j RETURN`, 5, 600},
		{`-A C -d 1.2.3.4/32 -c 7 8`, `-d 1.2.3.4/32`, 7, 8},
		{`-A C -c 1 2 -g X`, `-g X`, 1, 2},
		{`-A C -c 18446744073709551615 0 -j MASQUERADE --random-fully`, `-j MASQUERADE --random-fully`, 1<<64 - 1, 0},
		{`-A C -m comment --comment "-c 3 4" -c 0 0 -j RETURN`, `-m comment --comment "-c 3 4" -j RETURN`, 0, 0},
	} {
		r, err := iptables.ParseListedRule(c.line, true)
		if err != nil {
			t.Errorf("%q: %v", c.line, err)
			continue
		}
		if r.Chain != "C" || r.Spec != c.spec || r.Packets != c.packets || r.Bytes != c.bytes {
			t.Errorf("%q read as %+v, want spec %q, %d packets, %d bytes", c.line, r, c.spec, c.packets, c.bytes)
		}
	}
	for _, bad := range []string{`-A C -d 10.0.0.0/8 -j RETURN`, `-A C -m comment --comment "-c 1 2" -j RETURN`, `-A C -c x 2 -j RETURN`, `-A C -m comment --comment "open -c 1 2`} {
		if r, err := iptables.ParseListedRule(bad, true); err == nil {
			t.Errorf("%q read as %+v, want an error", bad, r)
		}
	}
	// Without -v, a rule's text is left as it is.
	if r, err := iptables.ParseListedRule(`-A C -c 1 2 -j RETURN`, false); err != nil || r.Spec != `-c 1 2 -j RETURN` {
		t.Errorf("without counters: %+v %v", r, err)
	}
}

// The listing ReadChains makes reads each chain as iptables-save -c prints it, counters included,
// on a nat table as kube-proxy fills it (comments, statistic, mark, DNAT, addrtype), in both
// modes, through the real tools: a chain that does not exist is left out, and a tool that cannot
// run (legacy without a lock file it can open) fails the read.
func TestListingReadsAsSave(t *testing.T) {
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		t.Run(string(mode), func(t *testing.T) {
			testutil.RequirePrivileged(t, "ip", "iptables-"+string(mode)+"-restore")
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ns := testutil.NewNetns(t)
			r := iptables.ExecRunner{Prefix: []string{"ip", "netns", "exec", ns}}
			// Every rule gets counters of its own: [n:100n].
			var payload strings.Builder
			n := 0
			for _, line := range strings.Split(string(iptablestest.KubeProxyNAT(300)), "\n") {
				if strings.HasPrefix(line, "-A ") {
					n++
					line = fmt.Sprintf("[%d:%d] %s", n, 100*n, line)
				}
				payload.WriteString(line + "\n")
			}
			t.Logf("%d rules", n)
			tl, err := iptables.ResolveTools(ctx, r, mode, policy.IPv4)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := r.Run(ctx, []byte(payload.String()), "iptables-"+string(mode)+"-restore", "--noflush", "--counters"); err != nil {
				t.Fatal(err)
			}
			out, err := r.Run(ctx, nil, "iptables-"+string(mode)+"-save", "-c", "-t", "nat")
			if err != nil {
				t.Fatal(err)
			}
			saved, err := iptables.ParseSave(out, "nat")
			if err != nil {
				t.Fatal(err)
			}
			chains := []string{"POSTROUTING", "KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"}
			for _, c := range saved.Chains {
				if strings.HasPrefix(c, "KUBE-SVC-") || strings.HasPrefix(c, "KUBE-SEP-") {
					chains = append(chains, c)
					if len(chains) == 8 {
						break
					}
				}
			}
			for _, chain := range chains {
				listed, err := iptables.ReadChains(ctx, r, tl, true, chain, "NO-SUCH-CHAIN")
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(listed.Chains, []string{chain}) {
					t.Errorf("chains read %q, want only %s", listed.Chains, chain)
				}
				if got, want := listed.ChainRules(chain), saved.ChainRules(chain); !slices.Equal(got, want) || len(want) == 0 && chain != "POSTROUTING" {
					t.Errorf("%s listed as\n %+v\nsaved as\n %+v", chain, got, want)
				}
				alone, err := iptables.ListChain(ctx, r, tl, chain, true)
				if err != nil || !slices.Equal(alone, saved.ChainRules(chain)) {
					t.Errorf("%s listed alone as %+v (%v)", chain, alone, err)
				}
			}
			if mode == iptables.ModeLegacy {
				lock := filepath.Join(t.TempDir(), "missing", "xtables.lock")
				locked := iptables.ExecRunner{Prefix: append([]string{"env", "XTABLES_LOCKFILE=" + lock}, r.Prefix...)}
				if got, err := iptables.ReadChains(ctx, locked, tl, true, "KUBE-SERVICES"); err == nil {
					t.Errorf("read without a lock file: %+v, want an error", got)
				}
			}
		})
	}
}

// What each operation reads, per mode, on the fake: never the whole nat table in nft mode (one
// listing per chain: the scrape lists the chain with counters, the drift check and an apply list
// it and POSTROUTING); in legacy mode, where any read fetches the whole table from the kernel,
// one read per family and operation. Both modes report the same counters.
func TestReadsOnlyItsChains(t *testing.T) {
	ctx := context.Background()
	p := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]", policy.Options{EnableIPv6: true, RandomFully: true})
	changed := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, 11.0.0.0/8, fc00::/7]", policy.Options{EnableIPv6: true, RandomFully: true})
	want := map[iptables.Mode]map[string][]string{
		iptables.ModeNFT: {
			"scrape": {"iptables-nft --wait -t nat -S IP-MASQ-AGENT -v", "ip6tables-nft --wait -t nat -S IP-MASQ-AGENT -v"},
			"drift": {"iptables-nft --wait -t nat -S POSTROUTING", "iptables-nft --wait -t nat -S IP-MASQ-AGENT",
				"ip6tables-nft --wait -t nat -S POSTROUTING", "ip6tables-nft --wait -t nat -S IP-MASQ-AGENT"},
			"apply": {"iptables-nft --wait -t nat -S POSTROUTING -v", "iptables-nft --wait -t nat -S IP-MASQ-AGENT -v",
				"ip6tables-nft --wait -t nat -S POSTROUTING -v", "ip6tables-nft --wait -t nat -S IP-MASQ-AGENT -v"},
		},
		iptables.ModeLegacy: {
			"scrape": {"iptables-legacy --wait -t nat -S IP-MASQ-AGENT -v", "ip6tables-legacy --wait -t nat -S IP-MASQ-AGENT -v"},
			"drift":  {"iptables-legacy-save -t nat", "ip6tables-legacy-save -t nat"},
			"apply":  {"iptables-legacy-save -t nat -c", "ip6tables-legacy-save -t nat -c"},
		},
	}
	var counters [][]datapath.RuleCounter
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		f := iptablestest.New()
		b, err := iptables.New(ctx, iptables.Options{Runner: f, Mode: mode})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
		for _, fam := range policy.Families() {
			rules := f.NAT(mode, fam).Rules[iptables.DefaultChain]
			for i := range rules {
				rules[i].Packets, rules[i].Bytes = uint64(i+1), uint64(100*(i+1))
			}
		}
		reads := func(op string, do func() error) {
			t.Helper()
			before := len(f.Calls)
			if err := do(); err != nil {
				t.Fatalf("%s %s: %v", mode, op, err)
			}
			var got []string
			for _, c := range f.Calls[before:] {
				if !strings.HasSuffix(c.Name, "-restore") {
					got = append(got, strings.Join(append([]string{c.Name}, c.Args...), " "))
				}
			}
			if !slices.Equal(got, want[mode][op]) {
				t.Errorf("%s %s read\n %q\nwant\n %q", mode, op, got, want[mode][op])
			}
		}
		var c []datapath.RuleCounter
		reads("scrape", func() (err error) { c, err = b.Counters(ctx); return err })
		counters = append(counters, c)
		reads("drift", func() error {
			drift, err := b.CheckDrift(ctx)
			if len(drift) > 0 {
				return fmt.Errorf("drift %q", drift)
			}
			return err
		})
		reads("apply", func() error { return b.Apply(ctx, p) })
		reads("apply", func() error { return b.Apply(ctx, changed) })
		if got := f.ChainTexts(mode, policy.IPv4, iptables.DefaultChain); !slices.Equal(got, lineTexts(changed, policy.IPv4)) {
			t.Errorf("%s chain after the change: %q", mode, got)
		}
		// A chain deleted behind the agent's back has no counters; that is no error.
		for _, fam := range policy.Families() {
			nat := f.NAT(mode, fam)
			nat.Rules["POSTROUTING"] = nil
			delete(nat.Rules, iptables.DefaultChain)
			nat.Chains = slices.DeleteFunc(nat.Chains, func(c string) bool { return c == iptables.DefaultChain })
		}
		if c, err := b.Counters(ctx); err != nil || len(c) != 0 {
			t.Errorf("%s counters without the chain: %+v %v", mode, c, err)
		}
	}
	if len(counters[0]) == 0 || !slices.Equal(counters[0], counters[1]) {
		t.Errorf("counters read in nft mode\n %+v\nin legacy mode\n %+v", counters[0], counters[1])
	}
}
