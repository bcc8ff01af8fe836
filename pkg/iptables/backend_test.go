package iptables_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables/iptablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// defaultJump is the POSTROUTING jump to the default chain, as iptables-save prints it.
var defaultJump = iptables.JumpRule(iptables.DefaultChain).String()

func testPolicy(t *testing.T, doc string, opts policy.Options) *policy.Policy {
	t.Helper()
	cfg, err := config.Parse([]byte(doc), config.Options{EnableIPv6: opts.EnableIPv6})
	if err != nil {
		t.Fatalf("parse config: %v", err)
	}
	return policy.Compile(cfg, opts)
}

func newFakeBackend(t *testing.T, f *iptablestest.Fake) *iptables.Backend {
	t.Helper()
	b, err := iptables.New(context.Background(), iptables.Options{Runner: f})
	if err != nil {
		t.Fatalf("new backend: %v", err)
	}
	return b
}

func lineTexts(p *policy.Policy, fam policy.Family) []string {
	var out []string
	for _, l := range iptables.ChainLines(p, fam, iptables.DefaultChain) {
		out = append(out, l.Rule.String())
	}
	return out
}

func TestApplyInstallsChainAndJumpOnce(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	if b.Mode() != iptables.ModeNFT {
		t.Fatalf("mode = %s, want nft on a node without rules", b.Mode())
	}
	p := testPolicy(t, "masqueradeCIDRs: [10.10.10.10/32]", policy.Options{RandomFully: true})
	for i := range 3 {
		if err := b.Apply(ctx, p); err != nil {
			t.Fatalf("apply #%d: %v", i+1, err)
		}
	}
	if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, iptables.DefaultChain), lineTexts(p, policy.IPv4); !slices.Equal(got, want) {
		t.Errorf("chain:\n got %q\nwant %q", got, want)
	}
	if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, "POSTROUTING"), []string{defaultJump}; !slices.Equal(got, want) {
		t.Errorf("POSTROUTING = %q, want exactly one jump %q", got, want)
	}
	var withJump int
	for _, payload := range f.Restores() {
		if strings.Contains(payload, defaultJump) {
			withJump++
		}
	}
	if withJump != 1 {
		t.Errorf("%d payloads carried the jump, want only the first", withJump)
	}
	if len(f.Stack(iptables.ModeLegacy, policy.IPv4).Tables) != 0 {
		t.Errorf("apply in nft mode touched legacy tables")
	}

	// Duplicated jumps (two agents overlapping) are reduced to one; other rules stay.
	nat := f.NAT(iptables.ModeNFT, policy.IPv4)
	other := iptablestest.Rule{Text: "-A POSTROUTING -s 10.0.0.0/8 -j RETURN"}
	nat.Rules["POSTROUTING"] = append(nat.Rules["POSTROUTING"], other, iptablestest.Rule{Text: defaultJump}, iptablestest.Rule{Text: defaultJump})
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, "POSTROUTING"), []string{other.Text, defaultJump}; !slices.Equal(got, want) {
		t.Errorf("POSTROUTING after dedup = %q, want %q", got, want)
	}
}

func TestApplyReplacesAndHealsDrift(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	first := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, 100.64.0.0/10]", policy.Options{})
	second := testPolicy(t, "nonMasqueradeCIDRs: [192.168.0.0/16]\nmasqLinkLocal: true", policy.Options{})
	if err := b.Apply(ctx, first); err != nil {
		t.Fatal(err)
	}
	if err := b.Apply(ctx, second); err != nil {
		t.Fatal(err)
	}
	if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, iptables.DefaultChain), lineTexts(second, policy.IPv4); !slices.Equal(got, want) {
		t.Fatalf("after a new policy the chain is\n %q\nwant\n %q", got, want)
	}
	// Someone flushes the chain and deletes the jump; the next apply (the resync) repairs both.
	nat := f.NAT(iptables.ModeNFT, policy.IPv4)
	nat.Rules[iptables.DefaultChain] = nil
	nat.Rules["POSTROUTING"] = nil
	if err := b.Apply(ctx, second); err != nil {
		t.Fatal(err)
	}
	if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, iptables.DefaultChain), lineTexts(second, policy.IPv4); !slices.Equal(got, want) {
		t.Errorf("drift not healed: chain %q, want %q", got, want)
	}
	if got := f.ChainTexts(iptables.ModeNFT, policy.IPv4, "POSTROUTING"); !slices.Equal(got, []string{defaultJump}) {
		t.Errorf("drift not healed: POSTROUTING %q", got)
	}
}

func TestApplyIPv6(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	p := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]", policy.Options{EnableIPv6: true})
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv6, iptables.DefaultChain), lineTexts(p, policy.IPv6); !slices.Equal(got, want) {
		t.Errorf("IPv6 chain %q, want %q", got, want)
	}
	if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, iptables.DefaultChain), lineTexts(p, policy.IPv4); !slices.Equal(got, want) {
		t.Errorf("IPv4 chain %q, want %q", got, want)
	}

	// A later run without --enable-ipv6 removes the IPv6 chain and jump it no longer manages.
	b2 := newFakeBackend(t, f)
	v4only := testPolicy(t, "", policy.Options{})
	if err := b2.Apply(ctx, v4only); err != nil {
		t.Fatal(err)
	}
	nat6 := f.NAT(iptables.ModeNFT, policy.IPv6)
	if nat6.Has(iptables.DefaultChain) || len(nat6.Rules["POSTROUTING"]) != 0 {
		t.Errorf("stale IPv6 chain left: chains %q, POSTROUTING %+v", nat6.Chains, nat6.Rules["POSTROUTING"])
	}
	// The check runs once per process, not on every resync.
	before := len(f.Calls)
	if err := b2.Apply(ctx, v4only); err != nil {
		t.Fatal(err)
	}
	for _, c := range f.Calls[before:] {
		if strings.HasPrefix(c.Name, "ip6tables") {
			t.Errorf("second apply without IPv6 ran %s", c.Name)
		}
	}
}

func TestApplyIPv6MissingTools(t *testing.T) {
	f := iptablestest.New()
	for _, n := range []string{"ip6tables-nft-save", "ip6tables-nft-restore", "ip6tables-save", "ip6tables-restore"} {
		delete(f.Installed, n)
	}
	b := newFakeBackend(t, f)
	err := b.Apply(context.Background(), testPolicy(t, "", policy.Options{EnableIPv6: true}))
	var missing *iptables.MissingToolsError
	if !errors.As(err, &missing) || !strings.Contains(err.Error(), `install the "iptables" package`) || !strings.Contains(err.Error(), "ip6tables-nft-restore") {
		t.Fatalf("err = %v, want a MissingToolsError naming ip6tables-nft-restore and the package", err)
	}
}

func TestNewMissingTools(t *testing.T) {
	f := iptablestest.New()
	f.Installed = map[string]bool{}
	_, err := iptables.New(context.Background(), iptables.Options{Runner: f})
	if err == nil || !strings.Contains(err.Error(), "apt-get install iptables") {
		t.Fatalf("err = %v, want one naming the package to install", err)
	}
	// Only the plain tools, and they are legacy: a forced nft mode finds nothing.
	f = iptablestest.New()
	for n := range f.Installed {
		if strings.Contains(n, "-nft") {
			delete(f.Installed, n)
		}
	}
	_, err = iptables.New(context.Background(), iptables.Options{Runner: f, Mode: iptables.ModeLegacy})
	if err != nil {
		t.Fatalf("legacy tools are installed: %v", err)
	}
}

func TestRandomFullyFallback(t *testing.T) {
	ctx := context.Background()
	p := testPolicy(t, "", policy.Options{RandomFully: true})
	noRandom := *p
	noRandom.RandomFully = false

	t.Run("kernel rejects it", func(t *testing.T) {
		f := iptablestest.New()
		f.RejectRandomFully = true
		b := newFakeBackend(t, f)
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
		if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, iptables.DefaultChain), lineTexts(&noRandom, policy.IPv4); !slices.Equal(got, want) {
			t.Errorf("chain %q, want %q", got, want)
		}
		if f.NAT(iptables.ModeNFT, policy.IPv4).Has(iptables.ProbeChain) {
			t.Errorf("probe chain left behind")
		}
		// The probe runs once: after a drift the next apply restores the chain only.
		f.NAT(iptables.ModeNFT, policy.IPv4).Rules[iptables.DefaultChain] = nil
		n := len(f.Restores())
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
		if got := f.Restores()[n:]; len(got) != 1 || strings.Contains(got[0], iptables.ProbeChain) {
			t.Errorf("second apply ran restores %q, want one without a new probe", got)
		}
	})
	t.Run("iptables too old", func(t *testing.T) {
		f := iptablestest.New()
		f.Version = "v1.6.1"
		b := newFakeBackend(t, f)
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
		if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, iptables.DefaultChain), lineTexts(&noRandom, policy.IPv4); !slices.Equal(got, want) {
			t.Errorf("chain %q, want %q", got, want)
		}
		for _, c := range f.Calls {
			if slices.Contains(c.Args, "--wait") {
				t.Errorf("%s got --wait, which 1.6.1 does not know", c.Name)
			}
		}
	})
	// iptables-legacy without a writable lock file fails on every restore: the probe says
	// nothing about --random-fully then, the apply fails with iptables' own reason, and once
	// the lock works the option is used.
	t.Run("xtables lock not writable", func(t *testing.T) {
		f := iptablestest.New()
		f.LockFile = "/run/xtables.lock"
		var logs strings.Builder
		b, err := iptables.New(ctx, iptables.Options{Runner: f, Mode: iptables.ModeLegacy, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		err = b.Apply(ctx, p)
		if err == nil {
			t.Fatal("apply succeeded without the xtables lock")
		}
		for _, want := range []string{"can't open lock file /run/xtables.lock: Read-only file system", "mount the node's /run/xtables.lock", "fails without the option too"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not say %q", err, want)
			}
		}
		if strings.Contains(logs.String(), "rejects") {
			t.Errorf("the lock failure was taken for a rejection of --random-fully:\n%s", logs.String())
		}
		f.LockFile = ""
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
		if got, want := f.ChainTexts(iptables.ModeLegacy, policy.IPv4, iptables.DefaultChain), lineTexts(p, policy.IPv4); !slices.Equal(got, want) {
			t.Errorf("chain once the lock works %q, want %q (with --random-fully)", got, want)
		}
	})
	t.Run("supported", func(t *testing.T) {
		f := iptablestest.New()
		b := newFakeBackend(t, f)
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
		if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, iptables.DefaultChain), lineTexts(p, policy.IPv4); !slices.Equal(got, want) {
			t.Errorf("chain %q, want %q", got, want)
		}
		if f.NAT(iptables.ModeNFT, policy.IPv4).Has(iptables.ProbeChain) {
			t.Errorf("probe chain left behind")
		}
	})
}

func TestRestoreErrorCarriesIptablesMessage(t *testing.T) {
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	f.FailRestore = iptables.DefaultChain
	err := b.Apply(context.Background(), testPolicy(t, "", policy.Options{}))
	if err == nil {
		t.Fatal("apply succeeded although iptables-restore failed")
	}
	for _, want := range []string{
		"iptables-restore: line 2 failed: No chain/target/match by that name.",
		"payload line 2: :IP-MASQ-AGENT - [0:0]",
		"apply ipv4 chain IP-MASQ-AGENT",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "Try `") {
		t.Errorf("error keeps iptables' usage hint: %q", err)
	}
	// Nothing was half-applied.
	if f.NAT(iptables.ModeNFT, policy.IPv4).Has(iptables.DefaultChain) {
		t.Errorf("failed transaction left the chain behind")
	}
}

func TestDetectMode(t *testing.T) {
	ctx := context.Background()
	addRules := func(f *iptablestest.Fake, mode iptables.Mode, fam policy.Family, n int) {
		nat := f.NAT(mode, fam)
		for i := range n {
			nat.Rules["POSTROUTING"] = append(nat.Rules["POSTROUTING"], iptablestest.Rule{Text: "-A POSTROUTING -s 10.0.0." + string(rune('0'+i)) + "/32 -j RETURN"})
		}
	}
	tests := []struct {
		name  string
		setup func(f *iptablestest.Fake)
		want  iptables.Mode
	}{
		{"nothing anywhere", func(*iptablestest.Fake) {}, iptables.ModeNFT},
		{"legacy holds more rules", func(f *iptablestest.Fake) {
			addRules(f, iptables.ModeLegacy, policy.IPv4, 2)
			addRules(f, iptables.ModeLegacy, policy.IPv6, 2)
			addRules(f, iptables.ModeNFT, policy.IPv4, 3)
		}, iptables.ModeLegacy},
		{"equal counts", func(f *iptablestest.Fake) {
			addRules(f, iptables.ModeLegacy, policy.IPv4, 2)
			addRules(f, iptables.ModeNFT, policy.IPv6, 2)
		}, iptables.ModeNFT},
		{"kubelet hint beats counts", func(f *iptablestest.Fake) {
			addRules(f, iptables.ModeNFT, policy.IPv4, 5)
			f.Stack(iptables.ModeLegacy, policy.IPv4).Tables["mangle"] = iptablestest.NewTable("PREROUTING", iptables.KubeletHintChain)
		}, iptables.ModeLegacy},
		{"only legacy tools", func(f *iptablestest.Fake) {
			for n := range f.Installed {
				if strings.Contains(n, "-nft") {
					delete(f.Installed, n)
				}
				// the plain names are nft in the fake; without nft they go too
				if !strings.Contains(n, "-legacy") {
					delete(f.Installed, n)
				}
			}
		}, iptables.ModeLegacy},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := iptablestest.New()
			tc.setup(f)
			got, err := iptables.DetectMode(ctx, f)
			if err != nil {
				t.Fatal(err)
			}
			if got.Mode != tc.want {
				t.Errorf("mode %s (%s), want %s", got.Mode, got.Reason, tc.want)
			}
			for _, c := range f.Calls {
				if slices.Contains(c.Args, "-t") {
					t.Errorf("detection ran %s %q: naming a table loads it", c.Name, c.Args)
				}
			}
		})
	}
}

func TestCounters(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	if c, err := b.Counters(ctx); err != nil || c != nil {
		t.Fatalf("counters before apply = %v, %v; want none", c, err)
	}
	ports, err := policy.ParsePortRanges("40000-40999,50000-50999")
	if err != nil {
		t.Fatal(err)
	}
	p := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8, fc00::/7]", policy.Options{EnableIPv6: true, ToPorts: ports})
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	// Give every live line distinct counters: line i gets i+1 packets and 100*(i+1) bytes.
	for _, fam := range policy.Families() {
		rules := f.NAT(iptables.ModeNFT, fam).Rules[iptables.DefaultChain]
		for i := range rules {
			rules[i].Packets, rules[i].Bytes = uint64(i+1), uint64(100*(i+1))
		}
	}
	got, err := b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Expected: per policy rule, the sum over its lines, in policy order.
	var want []datapath.RuleCounter
	for _, fam := range policy.Families() {
		line := 0
		for i, r := range p.Rules(fam) {
			c := datapath.RuleCounter{Family: fam, Rule: i + 1, Prefix: r.Prefix, Action: r.Action, Origin: r.Origin, Entry: r.Entry}
			n := 1
			if r.Action == policy.Masquerade {
				n = 3*2 + 1 // tcp, udp, sctp per port range, plus the portless line
			}
			for range n {
				line++
				c.Packets += uint64(line)
				c.Bytes += uint64(100 * line)
			}
			want = append(want, c)
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("counters\n got %+v\nwant %+v", got, want)
	}
	// The duplicate 10.0.0.0/8 rules (IPv4 #2 and #3) got their own lines: 2 and 3 packets.
	if got[1].Packets != 2 || got[2].Packets != 3 {
		t.Errorf("duplicate rules share a line: %+v %+v", got[1], got[2])
	}

	// A rule deleted behind the agent's back is left out, not reported as zero.
	nat := f.NAT(iptables.ModeNFT, policy.IPv4)
	nat.Rules[iptables.DefaultChain] = nat.Rules[iptables.DefaultChain][1:]
	got, err = b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range got {
		if c.Family == policy.IPv4 && c.Rule == 1 {
			t.Errorf("missing rule reported: %+v", c)
		}
	}
	if len(got) != len(want)-1 {
		t.Errorf("%d counters, want %d", len(got), len(want)-1)
	}
	if got[0].Prefix != netip.MustParsePrefix("10.0.0.0/8") || got[0].Packets != 2 {
		t.Errorf("first counter after drift = %+v", got[0])
	}
}

func TestCleanup(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	if err := b.Apply(ctx, testPolicy(t, "", policy.Options{EnableIPv6: true, RandomFully: true})); err != nil {
		t.Fatal(err)
	}
	// An earlier run in legacy mode left a chain there too, and someone duplicated the jump.
	legacy := f.NAT(iptables.ModeLegacy, policy.IPv4)
	legacy.Chains = append(legacy.Chains, iptables.DefaultChain)
	legacy.Rules[iptables.DefaultChain] = []iptablestest.Rule{{Text: "-A IP-MASQ-AGENT -j MASQUERADE"}}
	legacy.Rules["POSTROUTING"] = []iptablestest.Rule{{Text: defaultJump}, {Text: "-A POSTROUTING -j ACCEPT"}, {Text: defaultJump}}
	// Something unrelated stays.
	nft := f.NAT(iptables.ModeNFT, policy.IPv4)
	nft.Rules["POSTROUTING"] = append(nft.Rules["POSTROUTING"], iptablestest.Rule{Text: "-A POSTROUTING -s 10.0.0.0/8 -j RETURN"})

	for i := range 2 {
		if err := b.Cleanup(ctx); err != nil {
			t.Fatalf("cleanup #%d: %v", i+1, err)
		}
		for key, s := range f.Stacks {
			nat := s.Tables["nat"]
			if nat == nil {
				continue
			}
			if nat.Has(iptables.DefaultChain) || nat.Has(iptables.ProbeChain) {
				t.Errorf("cleanup #%d: %s still has a chain: %q", i+1, key, nat.Chains)
			}
			for _, r := range nat.Rules["POSTROUTING"] {
				if strings.Contains(r.Text, "-j "+iptables.DefaultChain) {
					t.Errorf("cleanup #%d: %s still jumps: %q", i+1, key, r.Text)
				}
			}
		}
	}
	if got := f.ChainTexts(iptables.ModeNFT, policy.IPv4, "POSTROUTING"); !slices.Equal(got, []string{"-A POSTROUTING -s 10.0.0.0/8 -j RETURN"}) {
		t.Errorf("cleanup touched other rules: %q", got)
	}
	if got := f.ChainTexts(iptables.ModeLegacy, policy.IPv4, "POSTROUTING"); !slices.Equal(got, []string{"-A POSTROUTING -j ACCEPT"}) {
		t.Errorf("cleanup touched other legacy rules: %q", got)
	}
	// The second cleanup found nothing and so restored nothing.
	n := len(f.Restores())
	if err := b.Cleanup(ctx); err != nil {
		t.Fatal(err)
	}
	if len(f.Restores()) != n {
		t.Errorf("cleanup with nothing installed ran iptables-restore")
	}
	if c, err := b.Counters(ctx); err != nil || c != nil {
		t.Errorf("counters after cleanup = %v, %v; want none", c, err)
	}
	// Cleaning up never creates a legacy IPv6 table that nobody used.
	if len(f.Stack(iptables.ModeLegacy, policy.IPv6).Tables) != 0 {
		t.Errorf("cleanup created legacy IPv6 tables")
	}
}

func TestParseSave(t *testing.T) {
	out := `# Generated by iptables-save v1.8.9 (nf_tables) on Mon Nov 30 04:15:06 2026
*filter
:INPUT ACCEPT [0:0]
-A INPUT -j ACCEPT
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [3:180]
:IP-MASQ-AGENT - [0:0]
[1:60] -A POSTROUTING -m comment --comment j -m addrtype ! --dst-type LOCAL -j IP-MASQ-AGENT
[0:0] -A IP-MASQ-AGENT -d 169.254.0.0/16 -m comment --comment "x y" -j RETURN
[18446744073709551615:7] -A IP-MASQ-AGENT -m comment --comment o -j MASQUERADE --random-fully
COMMIT
`
	nat, err := iptables.ParseSave([]byte(out), "nat")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(nat.Chains, []string{"PREROUTING", "POSTROUTING", "IP-MASQ-AGENT"}) {
		t.Errorf("chains %q", nat.Chains)
	}
	rules := nat.ChainRules("IP-MASQ-AGENT")
	want := []iptables.SavedRule{
		{Chain: "IP-MASQ-AGENT", Spec: `-d 169.254.0.0/16 -m comment --comment "x y" -j RETURN`,
			Target: "RETURN", Dst: netip.MustParsePrefix("169.254.0.0/16"), Comment: "x y"},
		{Chain: "IP-MASQ-AGENT", Spec: "-m comment --comment o -j MASQUERADE --random-fully",
			Target: "MASQUERADE", Comment: "o", RandomFully: true, Packets: 1<<64 - 1, Bytes: 7},
	}
	if !slices.Equal(rules, want) {
		t.Errorf("rules\n got %+v\nwant %+v", rules, want)
	}
	if got, want := rules[0].Text(), `-A IP-MASQ-AGENT -d 169.254.0.0/16 -m comment --comment "x y" -j RETURN`; got != want {
		t.Errorf("text %q, want the line as saved %q", got, want)
	}
	// Options inside a quoted comment are the comment's text, not options.
	quoted, err := iptables.ParseSave([]byte("*nat\n-A X -d 10.0.0.1/32 -m comment --comment \"a \\\" -j SNAT -d 1.0.0.0/8 --random-fully\" -j RETURN\nCOMMIT\n"), "nat")
	if err != nil {
		t.Fatal(err)
	}
	if r := quoted.Rules[0]; r.Target != "RETURN" || r.Dst != netip.MustParsePrefix("10.0.0.1/32") || r.RandomFully {
		t.Errorf("quoted comment read as options: %+v", r)
	}
	// SNAT's address, as Rule.toSource writes it: with ports, an IPv6 address in brackets; a
	// range of addresses is no one address.
	for to, want := range map[string]string{
		"192.0.2.11": "192.0.2.11", "192.0.2.11:40000-40099": "192.0.2.11", "2001:db8::11": "2001:db8::11",
		"[2001:db8::11]:40000-40099": "2001:db8::11", "192.0.2.11-192.0.2.19": "", "192.0.2.11-192.0.2.19:1024-2047": "",
	} {
		snat, err := iptables.ParseSave([]byte("*nat\n-A X -d 10.0.0.0/8 -j SNAT --to-source "+to+" --random-fully\nCOMMIT\n"), "nat")
		if err != nil {
			t.Fatal(err)
		}
		if got := snat.Rules[0].ToSource; (want == "" && got.IsValid()) || (want != "" && got != netip.MustParseAddr(want)) {
			t.Errorf("--to-source %s read as %v, want %q", to, got, want)
		}
	}
	if refs := nat.RulesTargeting("IP-MASQ-AGENT"); len(refs) != 1 || refs[0].Packets != 1 {
		t.Errorf("targeting %+v", refs)
	}
	if len(nat.RulesTargeting("IP-MASQ")) != 0 {
		t.Errorf("a chain name prefix matched")
	}
	if f, _ := iptables.ParseSave([]byte(out), "filter"); len(f.Rules) != 1 {
		t.Errorf("filter table %+v", f)
	}
	if m, _ := iptables.ParseSave([]byte(out), "mangle"); len(m.Chains)+len(m.Rules) != 0 {
		t.Errorf("absent table %+v", m)
	}
	for _, bad := range []string{"*nat\n[1:2 -A X\n", "*nat\n[x:2] -A X -j RETURN\n", "*nat\n-I X 1\n", "*nat\n-A X -m comment --comment \"open -j RETURN\n"} {
		if _, err := iptables.ParseSave([]byte(bad), "nat"); err == nil {
			t.Errorf("ParseSave(%q) succeeded", bad)
		}
	}
}

// setCounters gives every live line of the chain distinct counters: line i gets base+i packets
// and 100*(base+i) bytes.
func setCounters(f *iptablestest.Fake, fam policy.Family, base uint64) {
	rules := f.NAT(iptables.ModeNFT, fam).Rules[iptables.DefaultChain]
	for i := range rules {
		rules[i].Packets, rules[i].Bytes = base+uint64(i), 100*(base+uint64(i))
	}
}

func counterOf(t *testing.T, cs []datapath.RuleCounter, fam policy.Family, prefix string, origin policy.Origin) datapath.RuleCounter {
	t.Helper()
	for _, c := range cs {
		if c.Family == fam && c.Prefix == netip.MustParsePrefix(prefix) && c.Origin == origin {
			return c
		}
	}
	t.Fatalf("no counter for %s %s %s in %+v", fam, prefix, origin, cs)
	return datapath.RuleCounter{}
}

// A reload keeps the counters of the rules that stay, wherever they move, and starts new rules
// at zero; duplicates keep their own lines' counters, in order.
func TestApplyKeepsCountersOfRulesThatStay(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	first := testPolicy(t, "masqueradeCIDRs: [10.10.10.10/32]\nnonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8, 172.16.0.0/12, fc00::/7]", policy.Options{EnableIPv6: true})
	if err := b.Apply(ctx, first); err != nil {
		t.Fatal(err)
	}
	setCounters(f, policy.IPv4, 10)
	setCounters(f, policy.IPv6, 50)
	before, err := b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// 10.10.10.10/32 changes to /24, 172.16/12 goes, a new rule comes first: every kept rule
	// moves one place down.
	second := testPolicy(t, "masqueradeCIDRs: [192.0.2.0/24, 10.10.10.0/24]\nnonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8, fc00::/7]", policy.Options{EnableIPv6: true})
	if err := b.Apply(ctx, second); err != nil {
		t.Fatal(err)
	}
	if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, iptables.DefaultChain), lineTexts(second, policy.IPv4); !slices.Equal(got, want) {
		t.Fatalf("chain %q, want %q", got, want)
	}
	after, err := b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []struct {
		fam    policy.Family
		prefix string
		origin policy.Origin
	}{
		{policy.IPv4, "169.254.0.0/16", policy.OriginLinkLocal},
		{policy.IPv4, "0.0.0.0/0", policy.OriginOutbound},
		{policy.IPv6, "fe80::/10", policy.OriginLinkLocal},
		{policy.IPv6, "fc00::/7", policy.OriginNonMasqueradeCIDRs},
		{policy.IPv6, "::/0", policy.OriginOutbound},
	} {
		old, cur := counterOf(t, before, k.fam, k.prefix, k.origin), counterOf(t, after, k.fam, k.prefix, k.origin)
		if old.Packets == 0 || cur.Packets != old.Packets || cur.Bytes != old.Bytes {
			t.Errorf("%s %s: counters %d/%d after the reload, %d/%d before", k.fam, k.prefix, cur.Packets, cur.Bytes, old.Packets, old.Bytes)
		}
		if cur.Rule == old.Rule && k.origin == policy.OriginLinkLocal && k.fam == policy.IPv4 {
			t.Errorf("%s %s: rule number %d did not move; the test means to move it", k.fam, k.prefix, cur.Rule)
		}
	}
	// The duplicates keep their own counters, in order.
	var dups, oldDups []uint64
	for _, c := range after {
		if c.Prefix == netip.MustParsePrefix("10.0.0.0/8") {
			dups = append(dups, c.Packets)
		}
	}
	for _, c := range before {
		if c.Prefix == netip.MustParsePrefix("10.0.0.0/8") {
			oldDups = append(oldDups, c.Packets)
		}
	}
	if !slices.Equal(dups, oldDups) || len(dups) != 2 || dups[0] == dups[1] {
		t.Errorf("duplicate rules' counters %v after, %v before", dups, oldDups)
	}
	for _, prefix := range []string{"192.0.2.0/24", "10.10.10.0/24"} {
		if c := counterOf(t, after, policy.IPv4, prefix, policy.OriginMasqueradeCIDRs); c.Packets != 0 || c.Bytes != 0 {
			t.Errorf("new rule %s starts at %d/%d, want zero", prefix, c.Packets, c.Bytes)
		}
	}
	// The IPv4 transaction asked iptables to take the counters; the IPv6 chain did not change
	// and was not rewritten.
	var restores []iptablestest.Call
	for _, c := range f.Calls {
		if strings.HasSuffix(c.Name, "-restore") && strings.Contains(c.Stdin, iptables.DefaultChain) {
			restores = append(restores, c)
		}
	}
	if last := restores[len(restores)-1]; last.Name != "iptables-nft-restore" || !slices.Contains(last.Args, "--counters") {
		t.Errorf("last restore %s %q, want iptables-nft-restore with --counters", last.Name, last.Args)
	}
	if len(restores) != 3 {
		t.Errorf("%d restores of the chain, want 3 (both families, then IPv4 only)", len(restores))
	}

	// A new backend (an agent restart) keeps them too: they live in the kernel.
	b2 := newFakeBackend(t, f)
	if err := b2.Apply(ctx, second); err != nil {
		t.Fatal(err)
	}
	restarted, err := b2.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(restarted, after) {
		t.Errorf("after a restart\n got %+v\nwant %+v", restarted, after)
	}
}

// An apply that finds the chain as wanted (the periodic resync) rewrites nothing: a restore
// would lose the packets counted between reading the counters and writing them back.
func TestApplyUnchangedChainRestoresNothing(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	p := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8]", policy.Options{RandomFully: true})
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	n := len(f.Restores())
	for range 2 {
		if err := b.Apply(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	if got := f.Restores()[n:]; len(got) != 0 {
		t.Errorf("unchanged applies ran restores %q", got)
	}
	// A duplicated jump, or a missing chain line, is drift: repaired.
	nat := f.NAT(iptables.ModeNFT, policy.IPv4)
	nat.Rules["POSTROUTING"] = append(nat.Rules["POSTROUTING"], iptablestest.Rule{Text: defaultJump})
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	if got := f.ChainTexts(iptables.ModeNFT, policy.IPv4, "POSTROUTING"); len(got) != 1 {
		t.Errorf("POSTROUTING %q, want one jump", got)
	}
	nat.Rules[iptables.DefaultChain] = nat.Rules[iptables.DefaultChain][1:]
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	if got, want := f.ChainTexts(iptables.ModeNFT, policy.IPv4, iptables.DefaultChain), lineTexts(p, policy.IPv4); !slices.Equal(got, want) {
		t.Errorf("chain %q, want %q", got, want)
	}
}

// savedRules reads rule lines as iptables-save -c prints them.
func savedRules(t *testing.T, lines ...string) []iptables.SavedRule {
	t.Helper()
	nat, err := iptables.ParseSave([]byte("*nat\n"+strings.Join(lines, "\n")+"\nCOMMIT\n"), "nat")
	if err != nil {
		t.Fatal(err)
	}
	return nat.Rules
}

func TestRenderKeepingCounters(t *testing.T) {
	p := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8]", policy.Options{})
	lines := lineTexts(p, policy.IPv4)
	live := savedRules(t,
		"[3:30] "+lines[2], // the second 10/8 line's text (same as the first)
		"[9:90] -A IP-MASQ-AGENT -d 192.0.2.0/24 -j RETURN",
		"[2:20] "+lines[1],
		"[4:40] "+lines[3],
	)
	got, kept := iptables.RenderKeepingCounters(p, policy.IPv4, iptables.DefaultChain, false, live)
	want := "*nat\n:IP-MASQ-AGENT - [0:0]\n" + lines[0] + "\n[3:30] " + lines[1] + "\n[2:20] " + lines[2] + "\n[4:40] " + lines[3] + "\nCOMMIT\n"
	if string(got) != want || kept != 3 {
		t.Errorf("payload (kept %d):\n%s\nwant (kept 3):\n%s", kept, got, want)
	}
	// Without live lines it is exactly Render.
	if got, kept := iptables.RenderKeepingCounters(p, policy.IPv4, iptables.DefaultChain, true, nil); string(got) != string(iptables.Render(p, policy.IPv4, iptables.DefaultChain, true)) || kept != 0 {
		t.Errorf("without live lines:\n%s", got)
	}
}

// A scrape reads the counters while the agent applies: no data race, and every read reports
// rules of the old or the new policy with their counters.
func TestCountersDuringApply(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	policies := []*policy.Policy{
		testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]", policy.Options{EnableIPv6: true}),
		testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, fc00::/7]", policy.Options{EnableIPv6: true}),
	}
	if err := b.Apply(ctx, policies[0]); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	errs := make(chan error, 1)
	var reads atomic.Int64
	go func() {
		defer close(errs)
		for {
			select {
			case <-done:
				return
			default:
			}
			cs, err := b.Counters(ctx)
			if err != nil {
				errs <- err
				return
			}
			tenSlash8 := 0
			for _, c := range cs {
				if c.Prefix == netip.MustParsePrefix("10.0.0.0/8") {
					tenSlash8++
					if c.Origin != policy.OriginNonMasqueradeCIDRs {
						errs <- fmt.Errorf("counter %+v", c)
						return
					}
				}
			}
			if tenSlash8 != 1 {
				errs <- fmt.Errorf("a read with %d counters of 10.0.0.0/8, both policies have one: %+v", tenSlash8, cs)
				return
			}
			reads.Add(1)
			_ = b.Info()
		}
	}()
	for reads.Load() == 0 && len(errs) == 0 {
		runtime.Gosched() // reads must run while the applies do
	}
	// At least 50 applies, and as many reads while they run (for at most 20 s).
	before := reads.Load()
	deadline := time.Now().Add(20 * time.Second)
	i := 0
	for ; (i < 50 || reads.Load()-before < 50) && len(errs) == 0 && time.Now().Before(deadline); i++ {
		if err := b.Apply(ctx, policies[i%2]); err != nil {
			t.Fatal(err)
		}
	}
	during := reads.Load() - before
	close(done)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	if during < 50 {
		t.Fatalf("%d counter reads during %d applies", during, i)
	}
}
