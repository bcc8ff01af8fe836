package nftables_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/nftables/nftablestest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy/policytest"
)

// drawPolicy draws a random policy with up to n source rules, now and then with masquerade
// addresses and IPv6.
func drawPolicy(r *rand.Rand, n int) *policy.Policy {
	cfg := policytest.Config(r, r.IntN(20))
	if r.IntN(2) == 0 {
		cfg = policytest.WithAddresses(r, cfg)
	}
	opts := policy.Options{EnableIPv6: r.IntN(4) > 0, RandomFully: true}
	cfg, opts = policytest.WithSourceRules(r, cfg, n, opts)
	return policy.Compile(cfg, opts)
}

// probe is a packet's source and destination.
type probe struct{ src, dst netip.Addr }

func (pr probe) String() string { return pr.src.String() + " -> " + pr.dst.String() }

// probes draws packets of both families to probe p with: sources aimed at the source rules,
// destinations at the rules of the global lists or of a source rule's.
func probes(r *rand.Rand, p *policy.Policy, n int) []probe {
	var out []probe
	for _, fam := range policy.Families() {
		for range n {
			lists := p
			if len(p.Sources) > 0 && r.IntN(2) == 0 {
				lists = p.Sources[r.IntN(len(p.Sources))].Policy
			}
			out = append(out, probe{policytest.Source(r, p, fam), policytest.Destination(r, lists, fam)})
		}
	}
	return out
}

// sourceRuleName is the name of a verdict's source rule, "" for the global lists.
func sourceRuleName(v policy.Verdict) string {
	if v.SourceRule == nil {
		return ""
	}
	return v.SourceRule.Name
}

// countedIn is the list (source rule name, "" for the global lists) and the number in it of
// the rule whose counter a traced packet went to (0: none).
func countedIn(t *testing.T, p *policy.Policy, l *nftables.Layout, v nftablestest.Verdict) (string, int) {
	t.Helper()
	first, outbound := 0, l.Outbound
	if v.SourceRule != "" {
		i := slices.IndexFunc(l.Sources, func(s nftables.SourceList) bool { return s.Name == v.SourceRule })
		if i < 0 {
			t.Fatalf("traced to source rule %s, which the layout has no list of", v.SourceRule)
		}
		first, outbound = l.Sources[i].First, l.Sources[i].Outbound
	}
	switch {
	case v.Outbound:
		return v.SourceRule, outbound - first + 1
	case v.Set == "":
		return v.SourceRule, 0
	}
	rules := l.Rules(p)
	for _, e := range l.Elements {
		if e.Set == v.Set && e.Key == v.Key {
			if rules[e.Rule].Set != v.SourceRule {
				t.Fatalf("traced element %s %s of source rule %q in the chain of %q", v.Set, v.Key, rules[e.Rule].Set, v.SourceRule)
			}
			return v.SourceRule, e.Rule - first + 1
		}
	}
	t.Fatalf("traced element %s %s is not in the layout", v.Set, v.Key)
	return "", 0
}

// checkTraces holds the fake's rules to DecideFrom for each probe: the action, the address
// SNATed to, the source rule whose lists decided, and the rule that counted the packet.
func checkTraces(t *testing.T, f *nftablestest.Fake, p *policy.Policy, pkts []probe, what string) {
	t.Helper()
	layouts := map[policy.Family]*nftables.Layout{}
	for _, fam := range policy.Families() {
		if p.Enabled(fam) {
			layouts[fam] = nftables.NewLayout(p, fam)
		}
	}
	for _, pr := range pkts {
		fam := policy.FamilyOf(pr.dst)
		want := p.DecideFrom(pr.src, pr.dst)
		got, err := f.TraceFrom(pr.src, pr.dst, false)
		if err != nil {
			t.Fatal(err)
		}
		fail := func(format string, args ...any) {
			t.Helper()
			t.Fatalf("%s: %s: %s\n%s", what, pr, fmt.Sprintf(format, args...), f.Dump(fam))
		}
		if got.Action != want.Action {
			fail("traced %s, DecideFrom %s (source rule %q, rule %d)", got.Action, want.Action, sourceRuleName(want), want.Number)
		}
		if want.Rule != nil && want.Action == policy.Masquerade && got.Source != want.Rule.Address {
			fail("traced to the source %v, DecideFrom's rule %d to %v", got.Source, want.Number, want.Rule.Address)
		}
		if !p.Enabled(fam) {
			continue
		}
		if got.SourceRule != sourceRuleName(want) {
			fail("traced through the lists of %q, DecideFrom's are %q's", got.SourceRule, sourceRuleName(want))
		}
		if set, n := countedIn(t, p, layouts[fam], got); set != sourceRuleName(want) || n != want.Number {
			fail("counted by rule %d of %q, DecideFrom's rule %d of %q", n, set, want.Number, sourceRuleName(want))
		}
		if local, _ := f.TraceFrom(pr.src, pr.dst, true); local.Action != policy.Return || local.Set != "" || local.Outbound {
			fail("as a node address: %+v", local)
		}
	}
}

// The rules the backend installs for policies with source rules, run by the tracer, decide as
// DecideFrom does: random policies applied one after the other (each an update of the last, now
// and then without source rules), and the element that counts a packet belongs to the rule of
// the source rule's list DecideFrom names. After each update the table equals the one a fresh
// backend installs.
func TestTracedRulesEqualDecideFrom(t *testing.T) {
	r := rand.New(rand.NewPCG(40, 1))
	f := nftablestest.New()
	b := newBackend(t, f)
	withSources := 0
	for iter := range 150 {
		n := 6
		if iter%5 == 4 {
			n = 0
		}
		p := drawPolicy(r, n)
		if len(p.Sources) > 0 {
			withSources++
		}
		apply(t, b, p)
		checkTraces(t, f, p, probes(r, p, 40), fmt.Sprintf("iteration %d", iter))
		fresh := nftablestest.New()
		apply(t, newBackend(t, fresh), p)
		for _, fam := range policy.Families() {
			if got, want := sortedDump(f.Dump(fam)), sortedDump(fresh.Dump(fam)); got != want {
				t.Fatalf("iteration %d: %s: updated table\n%s\ndiffers from a fresh one\n%s", iter, fam, got, want)
			}
		}
	}
	if withSources < 100 {
		t.Errorf("%d of 150 policies had source rules", withSources)
	}
}

// Every state an apply passes through decides every probe of the family it changed as the old
// policy does (DecideFrom), or every one as the new policy does, for random policies with
// source rules applied one after the other. Half of the changes keep the source rules and move
// their lists' CIDRs within their prefix lengths, so that the elements of the source rules'
// sets change in the element batch.
func TestApplyStepsDecideAsOldOrNewFrom(t *testing.T) {
	r := rand.New(rand.NewPCG(40, 2))
	f := nftablestest.New()
	b := newBackend(t, f)
	var old, next *policy.Policy
	var pkts []probe
	decides := func(p *policy.Policy, pr probe, got nftablestest.Verdict) bool {
		if p == nil || !p.Enabled(policy.FamilyOf(pr.dst)) {
			return got.Action == policy.Return
		}
		want := p.DecideFrom(pr.src, pr.dst)
		return got.Action == want.Action && (want.Action != policy.Masquerade || want.Rule == nil || got.Source == want.Rule.Address)
	}
	f.Committed = func(fam policy.Family) {
		asOld, asNew := true, true
		var wrong []string
		for _, pr := range pkts {
			if policy.FamilyOf(pr.dst) != fam {
				continue
			}
			got, err := f.TraceFrom(pr.src, pr.dst, false)
			if err != nil {
				t.Fatal(err)
			}
			o, n := decides(old, pr, got), decides(next, pr, got)
			asOld, asNew = asOld && o, asNew && n
			if !o || !n {
				wrong = append(wrong, fmt.Sprintf("%s: %s to %v (as old: %v, as new: %v)", pr, got.Action, got.Source, o, n))
			}
		}
		if !asOld && !asNew {
			t.Fatalf("a state decides neither as the old policy nor as the new:\n%s\n%s", strings.Join(wrong, "\n"), f.Dump(fam))
		}
	}
	var cfg config.Config
	var opts policy.Options
	for i := range 150 {
		if i%2 == 0 || len(cfg.SourceRules) == 0 {
			cfg = policytest.Config(r, r.IntN(20))
			if r.IntN(2) == 0 {
				cfg = policytest.WithAddresses(r, cfg)
			}
			opts = policy.Options{EnableIPv6: r.IntN(4) > 0, RandomFully: true}
			cfg, opts = policytest.WithSourceRules(r, cfg, 5, opts)
		} else {
			cfg = moveSourceCIDRs(r, cfg)
		}
		next = policy.Compile(cfg, opts)
		pkts = probes(r, next, 30)
		if old != nil {
			pkts = append(pkts, probes(r, old, 30)...)
		}
		apply(t, b, next)
		old = next
	}
	if f.Batches[policy.IPv4] < 20 {
		t.Errorf("%d element batches for 150 applies: the source rules' elements never changed in a batch", f.Batches[policy.IPv4])
	}
	t.Logf("%d IPv4 transactions, %d batches", f.Runs[policy.IPv4], f.Batches[policy.IPv4])
}

// moveSourceCIDRs moves one nonMasqueradeCIDRs entry of each source rule elsewhere, keeping its
// prefix length.
func moveSourceCIDRs(r *rand.Rand, cfg config.Config) config.Config {
	cfg.SourceRules = slices.Clone(cfg.SourceRules)
	for i, s := range cfg.SourceRules {
		own := slices.Clone(s.Own.NonMasqueradeCIDRs)
		if len(own) == 0 {
			continue
		}
		j := r.IntN(len(own))
		moved, _ := policytest.AddrIn(r, netip.PrefixFrom(netip.IPv4Unspecified(), 0)).Prefix(own[j].Bits())
		if own[j].Addr().Is6() {
			moved, _ = policytest.AddrIn(r, netip.PrefixFrom(netip.IPv6Unspecified(), 0)).Prefix(own[j].Bits())
		}
		own[j] = moved
		cfg.SourceRules[i].Own.NonMasqueradeCIDRs = own
		cfg.SourceRules[i].Own.CIDRLimit = len(own)
	}
	return cfg
}

func hitFrom(t *testing.T, f *nftablestest.Fake, src, dst string, n int) nftablestest.Verdict {
	t.Helper()
	var v nftablestest.Verdict
	for range n {
		var err error
		if v, err = f.TraceFrom(netip.MustParseAddr(src), netip.MustParseAddr(dst), false); err != nil {
			t.Fatal(err)
		}
	}
	return v
}

// packetsBySet is packets with each counter's source rule in front: "web masqOutBound: true
// 0.0.0.0/0".
func packetsBySet(cs []datapath.RuleCounter) map[string]uint64 {
	out := map[string]uint64{}
	for _, c := range cs {
		// Source names a source rule's counters by the rule too; the key names it once.
		src := strings.TrimPrefix(c.Source(), config.KeySourceRules+"["+c.Set+"].")
		out[strings.TrimSpace(c.Set+" "+src+" "+c.Prefix.String())] += c.Packets
	}
	return out
}

// Two sources, one destination: each source rule's lists decide its sources' packets (one
// keeps them, one SNATs them to its own address), the global lists the others'; the counters
// name the source rules and keep their counts across applies that add and remove source
// rules; without source rules the table is as one that never had any.
func TestSourceRules(t *testing.T) {
	ctx := context.Background()
	parse := func(s string) config.Config {
		t.Helper()
		cfg, err := config.Parse([]byte(s), config.Options{})
		if err != nil {
			t.Fatal(err)
		}
		return cfg
	}
	const global = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
	cfg := parse(global + `sourceRules:
- name: batch
  cidrs: [10.244.1.0/24]
  masqOutBound: false
- name: web
  cidrs: [10.244.0.0/16]
  masqueradeAddress: 192.0.2.13
`)
	f := nftablestest.New()
	b := newBackend(t, f)
	apply(t, b, compile(cfg, false))
	for _, c := range []struct {
		src    string
		n      int
		action policy.Action
		rule   string
		to     string
	}{
		{"10.244.1.5", 2, policy.Return, "batch", ""},
		{"10.244.2.5", 3, policy.Masquerade, "web", "192.0.2.13"}, // web's /16 less batch's /24
		{"10.245.0.1", 4, policy.Masquerade, "", ""},
	} {
		v := hitFrom(t, f, c.src, "8.8.8.8", c.n)
		to := ""
		if v.Source.IsValid() {
			to = v.Source.String()
		}
		if v.Action != c.action || v.SourceRule != c.rule || to != c.to {
			t.Errorf("%s -> 8.8.8.8: %s by %q to %q, want %s by %q to %q", c.src, v.Action, v.SourceRule, to, c.action, c.rule, c.to)
		}
	}
	hitFrom(t, f, "10.244.2.5", "10.1.1.1", 1) // web's nonMasqueradeCIDRs, the global one
	counts := func(what string, sets []string, want map[string]uint64) {
		t.Helper()
		cs, err := b.Counters(ctx)
		if err != nil {
			t.Fatal(err)
		}
		got := packetsBySet(cs)
		if !mapsEqual(got, want) {
			t.Errorf("%s: counters %v, want %v", what, got, want)
		}
		// The global lists' counters first, then each source rule's, in rule order.
		var order []string
		for _, c := range cs {
			if len(order) == 0 || order[len(order)-1] != c.Set {
				order = append(order, c.Set)
			}
		}
		if !slices.Equal(order, sets) {
			t.Errorf("%s: counters in the order of %q, want %q", what, order, sets)
		}
	}
	counts("two rules", []string{"", "batch", "web"}, map[string]uint64{
		"link-local 169.254.0.0/16": 0, "nonMasqueradeCIDRs[0] 10.0.0.0/8": 0, "outbound 0.0.0.0/0": 4,
		"batch link-local 169.254.0.0/16": 0, "batch nonMasqueradeCIDRs[0] 10.0.0.0/8": 0,
		"web link-local 169.254.0.0/16": 0, "web nonMasqueradeCIDRs[0] 10.0.0.0/8": 1, "web outbound 0.0.0.0/0": 3,
	})

	// batch goes, db comes after web: batch's sources are web's now; web keeps its counts.
	cfg = parse(global + `sourceRules:
- name: web
  cidrs: [10.244.0.0/16]
  masqueradeAddress: 192.0.2.13
- name: db
  cidrs: [10.244.1.0/24, 10.250.0.0/16]
  masqOutBound: false
`)
	apply(t, b, compile(cfg, false))
	if v := hitFrom(t, f, "10.244.1.5", "8.8.8.8", 1); v.SourceRule != "web" || v.Source != netip.MustParseAddr("192.0.2.13") {
		t.Errorf("10.244.1.5 after batch went: %+v, want web's SNAT", v)
	}
	if v := hitFrom(t, f, "10.250.0.1", "8.8.8.8", 5); v.SourceRule != "db" || v.Action != policy.Return {
		t.Errorf("10.250.0.1: %+v, want db's RETURN", v)
	}
	counts("batch removed, db added", []string{"", "web", "db"}, map[string]uint64{
		"link-local 169.254.0.0/16": 0, "nonMasqueradeCIDRs[0] 10.0.0.0/8": 0, "outbound 0.0.0.0/0": 4,
		"web link-local 169.254.0.0/16": 0, "web nonMasqueradeCIDRs[0] 10.0.0.0/8": 1, "web outbound 0.0.0.0/0": 4,
		"db link-local 169.254.0.0/16": 0, "db nonMasqueradeCIDRs[0] 10.0.0.0/8": 0,
	})
	if f.Table(policy.IPv4).Sets["src.batch.return-8"] != nil || f.Table(policy.IPv4).Chains["src.batch"] != nil ||
		f.Table(policy.IPv4).Counters["src.batch.outbound"] != nil {
		t.Errorf("batch's objects stay:\n%s", f.Dump(policy.IPv4))
	}

	// No source rules: the table is the one a backend that never saw any installs.
	cfg = parse(global)
	apply(t, b, compile(cfg, false))
	fresh := nftablestest.New()
	apply(t, newBackend(t, fresh), compile(cfg, false))
	if got, want := sortedDump(f.Dump(policy.IPv4)), sortedDump(fresh.Dump(policy.IPv4)); got != want {
		t.Errorf("without source rules the table\n%s\ndiffers from a fresh one\n%s", got, want)
	}
	if v := hitFrom(t, f, "10.244.1.5", "8.8.8.8", 1); v.SourceRule != "" || v.Action != policy.Masquerade || v.Source.IsValid() {
		t.Errorf("without source rules: %+v", v)
	}
}

// A source rule whose sources an earlier one holds whole never decides a packet: it has no
// list in the table, and its rules count zero. dump, given the policy or not, names the source
// rules of what it reads.
func TestSourceRuleShadowedAndDump(t *testing.T) {
	ctx := context.Background()
	cfg, err := config.Parse([]byte(`
nonMasqueradeCIDRs: [10.0.0.0/8]
sourceRules:
- name: wide
  cidrs: [10.244.0.0/16]
  masqOutBound: false
- name: narrow
  cidrs: [10.244.1.0/24]
  nonMasqueradeCIDRs: [172.16.0.0/12]
`), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	p := compile(cfg, false)
	f := nftablestest.New()
	b := newBackend(t, f)
	apply(t, b, p)
	if l := nftables.NewLayout(p, policy.IPv4); len(l.Sources) != 1 || l.Sources[0].Name != "wide" {
		t.Fatalf("source lists %+v, want wide's alone", l.Sources)
	}
	hitFrom(t, f, "10.244.1.1", "8.8.8.8", 2)
	cs, err := b.Counters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := packetsBySet(cs), map[string]uint64{
		"link-local 169.254.0.0/16": 0, "nonMasqueradeCIDRs[0] 10.0.0.0/8": 0, "outbound 0.0.0.0/0": 0,
		"wide link-local 169.254.0.0/16": 0, "wide nonMasqueradeCIDRs[0] 10.0.0.0/8": 0,
		"narrow link-local 169.254.0.0/16": 0, "narrow nonMasqueradeCIDRs[0] 172.16.0.0/12": 0, "narrow outbound 0.0.0.0/0": 0,
	}; !mapsEqual(got, want) {
		t.Errorf("counters %v, want %v", got, want)
	}
	hitFrom(t, f, "10.244.1.1", "10.0.0.1", 3)
	for _, given := range []*policy.Policy{p, nil} {
		in, err := nftables.Inspect(ctx, f.Kernel(), given)
		if err != nil || in == nil {
			t.Fatalf("inspect: %v, %v", in, err)
		}
		cs, err := in.Counters(ctx)
		if err != nil {
			t.Fatal(err)
		}
		got := packetsBySet(cs)
		if got["wide nonMasqueradeCIDRs[0] 10.0.0.0/8"]+got["wide nonMasqueradeCIDRs 10.0.0.0/8"] != 3 {
			t.Errorf("dump (policy given: %v): %v, want wide's 10.0.0.0/8 at 3", given != nil, got)
		}
	}
}
