package iptables_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/iptables/iptablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// sourcesDoc has two source rules, each rule of every list one line (no --to-ports).
const sourcesDoc = `nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]
sourceRules:
  - name: batch
    cidrs: [10.244.8.0/21, "fd00:10:244:8::/64"]
    masqueradeAddress: 192.0.2.11
    nonMasqueradeCIDRs: []
  - name: keep
    cidrs: [10.244.0.0/16]
    masqOutBound: false
`

// wantLayout checks that the fake holds exactly the layout's chains in a mode and family.
func wantLayout(t *testing.T, f *iptablestest.Fake, mode iptables.Mode, p *policy.Policy, fam policy.Family) {
	t.Helper()
	for _, c := range iptables.Layout(p, fam, iptables.DefaultChain) {
		var want []string
		for _, l := range c.Lines {
			want = append(want, l.Rule.String())
		}
		if !f.NAT(mode, fam).Has(c.Name) {
			t.Errorf("%s: no chain %s", fam, c.Name)
		}
		if got := f.ChainTexts(mode, fam, c.Name); !slices.Equal(got, want) {
			t.Errorf("%s chain %s:\n got %q\nwant %q", fam, c.Name, got, want)
		}
	}
}

// sourceChains are the chains of the fake's nat table that are a source rule's chain of
// DefaultChain, by name.
func sourceChains(f *iptablestest.Fake, mode iptables.Mode, fam policy.Family) []string {
	var out []string
	for _, c := range f.NAT(mode, fam).Chains {
		if strings.HasPrefix(c, iptables.DefaultChain+"-") && c != iptables.ProbeChain {
			out = append(out, c)
		}
	}
	return out
}

// setRuleCounters gives line i of every chain of the layout distinct counters, and returns the
// counters each rule of the policy should then report, in the order Counters reports them: by
// list (the global one, then each source rule's), then by family.
func setRuleCounters(f *iptablestest.Fake, p *policy.Policy, base uint64) []datapath.RuleCounter {
	byList := make([][]datapath.RuleCounter, 1+len(p.Sources))
	for _, fam := range policy.Families() {
		for ci, c := range iptables.Layout(p, fam, iptables.DefaultChain) {
			list := 0
			if c.Source != nil {
				list = 1 + c.Source.Index
			}
			rules := f.NAT(iptables.ModeNFT, fam).Rules[c.Name]
			for i := range rules {
				n := base + uint64(1000*int(fam)+100*ci+i)
				rules[i].Packets, rules[i].Bytes = n, 60*n
				if pr := c.Lines[i].Policy; pr != nil {
					byList[list] = append(byList[list], datapath.RuleCounter{Set: pr.Set, Family: fam, Rule: c.Lines[i].Number,
						Prefix: pr.Prefix, Action: pr.Action, Origin: pr.Origin, Entry: pr.Entry, Address: pr.Address, Packets: n, Bytes: 60 * n})
				}
			}
		}
	}
	var want []datapath.RuleCounter
	for _, cs := range byList {
		want = append(want, cs...)
	}
	return want
}

// Source rules through the backend: each rule's chain in both families in one transaction per
// family, nothing restored while unchanged, counters per rule (the global lists' first, then
// each source rule's, in rule order), a removed rule's chain gone in the transaction that
// drops its gotos while the others keep their counters, drift in a rule's chain, and no chain
// left once the policy has no source rules.
func TestApplySourceRules(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	p := testPolicy(t, sourcesDoc, policy.Options{EnableIPv6: true})
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	for _, fam := range policy.Families() {
		wantLayout(t, f, iptables.ModeNFT, p, fam)
		// keep holds no IPv6 sources, so it has no IPv6 chain.
		if got, want := sourceChains(f, iptables.ModeNFT, fam), map[policy.Family]int{policy.IPv4: 2, policy.IPv6: 1}[fam]; len(got) != want {
			t.Errorf("%s source chains %q, want %d", fam, got, want)
		}
	}
	if n := len(f.Restores()); n != 2 {
		t.Errorf("%d restores, want one transaction per family", n)
	}
	n := len(f.Restores())
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	if got := f.Restores()[n:]; len(got) != 0 {
		t.Errorf("unchanged apply ran restores %q", got)
	}

	want := setRuleCounters(f, p, 1)
	got, err := b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("counters\n got %+v\nwant %+v", got, want)
	}
	var sets []string
	for _, c := range got {
		if len(sets) == 0 || sets[len(sets)-1] != c.Set+"/"+c.Family.String() {
			sets = append(sets, c.Set+"/"+c.Family.String())
		}
	}
	if w := []string{"/ipv4", "/ipv6", "batch/ipv4", "batch/ipv6", "keep/ipv4"}; !slices.Equal(sets, w) {
		t.Errorf("counters by list %q, want %q", sets, w)
	}

	// keep goes, a new rule comes first: keep's chain goes in the same transaction, batch
	// keeps its counters.
	second := testPolicy(t, `nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]
sourceRules:
  - name: fresh
    cidrs: [10.244.9.0/24]
    masqOutBound: false
  - name: batch
    cidrs: [10.244.8.0/21, "fd00:10:244:8::/64"]
    masqueradeAddress: 192.0.2.11
    nonMasqueradeCIDRs: []
`, policy.Options{EnableIPv6: true})
	n = len(f.Restores())
	if err := b.Apply(ctx, second); err != nil {
		t.Fatal(err)
	}
	keep := iptables.SourceChain(iptables.DefaultChain, "keep")
	restores := f.Restores()[n:]
	// Only IPv4's chains change: neither keep nor fresh holds IPv6 sources.
	if len(restores) != 1 || !strings.Contains(restores[0], "-s 10.244.9.0/24 ") {
		t.Fatalf("restores %q, want the IPv4 one only", restores)
	}
	for _, fam := range policy.Families() {
		wantLayout(t, f, iptables.ModeNFT, second, fam)
		if f.NAT(iptables.ModeNFT, fam).Has(keep) {
			t.Errorf("%s: the chain of the removed rule is left", fam)
		}
	}
	if !strings.Contains(restores[0], "\n-X "+keep+"\n") {
		t.Errorf("the removed rule's chain went in another transaction than\n%s", restores[0])
	}
	after, err := b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range want {
		if w.Set != "batch" {
			continue
		}
		i := slices.IndexFunc(after, func(c datapath.RuleCounter) bool {
			return c.Set == w.Set && c.Family == w.Family && c.Rule == w.Rule
		})
		if i < 0 || after[i] != w {
			t.Errorf("batch's rule %s #%d after the reload: %+v, want %+v", w.Family, w.Rule, after, w)
		}
	}
	if drift, err := b.CheckDrift(ctx); err != nil || len(drift) != 0 {
		t.Errorf("drift right after the apply: %q %v", drift, err)
	}

	// A source rule's chain flushed or changed behind the agent's back is drift, healed by the
	// next apply.
	batch := iptables.SourceChain(iptables.DefaultChain, "batch")
	f.NAT(iptables.ModeNFT, policy.IPv6).Rules[batch] = nil
	if drift, err := b.CheckDrift(ctx); err != nil || !slices.Equal(drift, []string{datapath.DriftChain}) {
		t.Errorf("drift after batch's IPv6 chain was flushed: %q %v", drift, err)
	}
	if err := b.Apply(ctx, second); err != nil {
		t.Fatal(err)
	}
	wantLayout(t, f, iptables.ModeNFT, second, policy.IPv6)
	if drift, err := b.CheckDrift(ctx); err != nil || len(drift) != 0 {
		t.Errorf("drift after the heal: %q %v", drift, err)
	}

	// Without source rules, no source chain is left and the chain is as it always was.
	none := testPolicy(t, "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]", policy.Options{EnableIPv6: true})
	if err := b.Apply(ctx, none); err != nil {
		t.Fatal(err)
	}
	for _, fam := range policy.Families() {
		if got := sourceChains(f, iptables.ModeNFT, fam); len(got) != 0 {
			t.Errorf("%s source chains left: %q", fam, got)
		}
		if got, want := f.ChainTexts(iptables.ModeNFT, fam, iptables.DefaultChain), lineTexts(none, fam); !slices.Equal(got, want) {
			t.Errorf("%s chain %q, want %q", fam, got, want)
		}
	}
}

// Cleanup removes the source chains whatever the configuration: a process that knows none of
// the rules finds them by name, in both modes, also one the main chain no longer goes to.
func TestCleanupSourceRules(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	p := testPolicy(t, sourcesDoc, policy.Options{EnableIPv6: true})
	if err := newFakeBackend(t, f).Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	legacy, err := iptables.New(ctx, iptables.Options{Runner: f, Mode: iptables.ModeLegacy})
	if err != nil {
		t.Fatal(err)
	}
	if err := legacy.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	orphan := iptables.SourceChain(iptables.DefaultChain, "gone")
	nat := f.NAT(iptables.ModeLegacy, policy.IPv4)
	nat.Chains = append(nat.Chains, orphan)
	nat.Rules[orphan] = []iptablestest.Rule{{Text: "-A " + orphan + " -j RETURN"}}
	// Another chain of a similar name is not ours.
	other := iptables.DefaultChain + "-OTHER"
	nat.Chains = append(nat.Chains, other)

	if err := newFakeBackend(t, f).Cleanup(ctx); err != nil {
		t.Fatal(err)
	}
	for _, mode := range []iptables.Mode{iptables.ModeNFT, iptables.ModeLegacy} {
		for _, fam := range policy.Families() {
			left := slices.DeleteFunc(sourceChains(f, mode, fam), func(c string) bool { return c == other })
			if f.NAT(mode, fam).Has(iptables.DefaultChain) || len(left) != 0 {
				t.Errorf("%s %s: chains left %q", mode, fam, f.NAT(mode, fam).Chains)
			}
		}
	}
	if !f.NAT(iptables.ModeLegacy, policy.IPv4).Has(other) {
		t.Errorf("cleanup removed %s, which is not the agent's", other)
	}
}

// dump reads the source rules' chains: with the configuration, the agent's counters; without
// it, each line as installed, named by its source rule; the gotos and the chains' ends are no
// rules of a list and not reported.
func TestInspectSourceRules(t *testing.T) {
	ctx := context.Background()
	f := iptablestest.New()
	b := newFakeBackend(t, f)
	p := testPolicy(t, sourcesDoc, policy.Options{EnableIPv6: true})
	if err := b.Apply(ctx, p); err != nil {
		t.Fatal(err)
	}
	want := setRuleCounters(f, p, 1)
	found, err := iptables.Inspect(ctx, f, iptables.DefaultChain, p)
	if err != nil || len(found) != 1 {
		t.Fatalf("inspect: %d installations, %v", len(found), err)
	}
	if d := found[0].Info().Details; d != "iptables-nft, chain IP-MASQ-AGENT (ipv4, ipv6), source rules batch, keep" {
		t.Errorf("details %q", d)
	}
	got, err := found[0].Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) {
		t.Errorf("dump's counters\n got %+v\nwant %+v", got, want)
	}

	found, err = iptables.Inspect(ctx, f, iptables.DefaultChain, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err = found[0].Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Errorf("%d lines without the configuration, want one per rule (%d): %+v", len(got), len(want), got)
	}
	perSet := map[string]int{}
	for _, c := range got {
		perSet[c.Set]++
		if c.Rule != 0 {
			t.Errorf("a line taken for a rule without a configuration: %+v", c)
		}
	}
	for _, set := range []string{"", "batch", "keep"} {
		w := 0
		for _, c := range want {
			if c.Set == set {
				w++
			}
		}
		if perSet[set] != w {
			t.Errorf("%d lines of list %q, want %d: %+v", perSet[set], set, w, got)
		}
	}
}

// SourceChains lists a main chain's source chains in rule order (the order of its gotos), not
// in the dump's (iptables-legacy sorts chains by name), then those it does not go to; others'
// chains are not among them.
func TestTableSourceChains(t *testing.T) {
	a, b, orphan := iptables.SourceChain(iptables.DefaultChain, "a"), iptables.SourceChain(iptables.DefaultChain, "b"), iptables.SourceChain(iptables.DefaultChain, "gone")
	chains := []string{a, b, orphan, "OTHER", iptables.SourceChain("OTHER", "a")}
	slices.Sort(chains)
	var dump strings.Builder
	dump.WriteString("*nat\n:POSTROUTING ACCEPT [0:0]\n:" + iptables.DefaultChain + " - [0:0]\n")
	for _, c := range chains {
		dump.WriteString(":" + c + " - [0:0]\n")
	}
	dump.WriteString("-A " + iptables.DefaultChain + " -s 10.1.0.0/16 -g " + b + "\n")
	dump.WriteString("-A " + iptables.DefaultChain + " -s 10.2.0.0/16 -g " + a + "\n")
	dump.WriteString("-A " + iptables.DefaultChain + " -s 10.3.0.0/16 -g " + b + "\nCOMMIT\n")
	nat, err := iptables.ParseSave([]byte(dump.String()), "nat")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := nat.SourceChains(iptables.DefaultChain), []string{b, a, orphan}; !slices.Equal(got, want) {
		t.Errorf("SourceChains = %q, want %q", got, want)
	}
}
