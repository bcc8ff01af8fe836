package policy_test

import (
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy/policytest"
)

// For random policies with source rules: the source table, read as an LPM table, names the
// first rule that holds each source; DecideFrom decides by that rule's lists, which are the
// rule's keys over the global ones, or by the global lists without one.
func TestSourceRulesRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for range 300 {
		opts := policy.Options{EnableIPv6: rng.IntN(2) == 0}
		cfg := policytest.WithAddresses(rng, policytest.Config(rng, rng.IntN(10)))
		cfg, opts = policytest.WithSourceRules(rng, cfg, 8, opts)
		p := policy.Compile(cfg, opts)
		if len(p.Sources) != len(cfg.SourceRules) {
			t.Fatalf("%d source rules compiled from %d", len(p.Sources), len(cfg.SourceRules))
		}
		for _, fam := range policy.Families() {
			table := p.SourceTable(fam)
			for range 200 {
				src := policytest.Source(rng, p, fam)
				want := -1
				for i, s := range cfg.SourceRules {
					held := false
					for _, c := range s.CIDRs {
						held = held || c.Contains(src)
					}
					for _, a := range opts.Pods[s.Name] {
						held = held || (s.Selects() && a == src)
					}
					if held {
						want = i
						break
					}
				}
				if got := p.SourceRuleOf(src); (got == nil) != (want < 0) || (got != nil && got.Index != want) {
					t.Fatalf("config %s pods %v: SourceRuleOf(%s) = %+v, want rule %d", cfg.Canonical(), opts.Pods, src, got, want)
				}
				// The longest entry that holds src.
				lpm := -1
				best := -1
				for _, e := range table {
					if e.Prefix.Contains(src) && e.Prefix.Bits() > best {
						best, lpm = e.Prefix.Bits(), e.Rule
					}
				}
				if lpm != want {
					t.Fatalf("config %s pods %v: the source table %v gives %s rule %d, want %d", cfg.Canonical(), opts.Pods, table, src, lpm, want)
				}
				dst := policytest.Destination(rng, p, fam)
				v := p.DecideFrom(src, dst)
				ref := p
				if want >= 0 && p.Enabled(fam) {
					ref = policy.Compile(cfg.SourceRules[want].Effective(cfg), policy.Options{EnableIPv6: opts.EnableIPv6})
				}
				w := ref.Decide(dst)
				if v.Action != w.Action || v.Number != w.Number || (w.Rule != nil && (v.Rule.Prefix != w.Rule.Prefix || v.Rule.Address != w.Rule.Address)) {
					t.Fatalf("config %s: DecideFrom(%s, %s) = %+v, want %+v", cfg.Canonical(), src, dst, v, w)
				}
				if (v.SourceRule != nil) != (want >= 0 && p.Enabled(fam)) {
					t.Fatalf("DecideFrom(%s, %s) names source rule %v, want %d", src, dst, v.SourceRule, want)
				}
			}
		}
	}
}

// A rule decides by its own keys and the global ones it leaves out; a source it does not hold
// is decided by the global keys; a selector rule holds its pods only.
func TestSourceRuleKeys(t *testing.T) {
	cfg, err := config.Parse([]byte(`
nonMasqueradeCIDRs: [10.0.0.0/8]
masqueradeAddress: 192.0.2.10
sourceRules:
- name: partner
  cidrs: [10.244.1.0/24]
  nonMasqueradeCIDRs: [10.0.0.0/8, 203.0.113.0/24]
- name: batch
  namespaceSelector: {matchLabels: {team: batch}}
  masqueradeAddress: 192.0.2.11
- name: quiet
  cidrs: [10.244.0.0/16]
  masqOutBound: false
`), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	p := policy.Compile(cfg, policy.Options{Pods: map[string][]netip.Addr{"batch": {netip.MustParseAddr("10.244.2.7")}}})
	for _, c := range []struct {
		src, dst   string
		action     policy.Action
		rule, from string
		address    string
	}{
		{"10.244.1.5", "203.0.113.1", policy.Return, "partner", "sourceRules[partner].nonMasqueradeCIDRs[1]", ""},
		{"10.244.1.5", "8.8.8.8", policy.Masquerade, "partner", "sourceRules[partner].masqOutBound: true", "192.0.2.10"},
		{"10.244.2.7", "8.8.8.8", policy.Masquerade, "batch", "sourceRules[batch].masqOutBound: true", "192.0.2.11"},
		{"10.244.2.7", "10.1.1.1", policy.Return, "batch", "sourceRules[batch].nonMasqueradeCIDRs[0]", ""},
		{"10.244.2.8", "8.8.8.8", policy.Return, "quiet", "", ""},
		{"10.245.0.1", "203.0.113.1", policy.Masquerade, "", "masqOutBound: true", "192.0.2.10"},
	} {
		v := p.DecideFrom(netip.MustParseAddr(c.src), netip.MustParseAddr(c.dst))
		name, from, addr := "", "", ""
		if v.SourceRule != nil {
			name = v.SourceRule.Name
		}
		if v.Rule != nil {
			from = v.Rule.Source()
			if v.Rule.Address.IsValid() {
				addr = v.Rule.Address.String()
			}
		}
		if v.Action != c.action || name != c.rule || from != c.from || addr != c.address {
			t.Errorf("%s -> %s: %v by %q (%q) from %q, want %v by %q (%q) from %q", c.src, c.dst, v.Action, name, from, addr,
				c.action, c.rule, c.from, c.address)
		}
	}
	var froms []string
	for _, u := range p.Addresses() {
		froms = append(froms, u.From+" "+u.Addr.String())
	}
	if want := "[masqueradeAddress 192.0.2.10 sourceRules[batch].masqueradeAddress 192.0.2.11]"; fmtList(froms) != want {
		t.Errorf("Addresses() = %v, want %s", froms, want)
	}
	if !p.MayMasquerade(netip.MustParsePrefix("203.0.113.0/24")) {
		t.Error("MayMasquerade(203.0.113.0/24) = false: the global lists masquerade it")
	}
}

func fmtList(s []string) string {
	out := "["
	for i, e := range s {
		if i > 0 {
			out += " "
		}
		out += e
	}
	return out + "]"
}
