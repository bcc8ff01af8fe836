package policy_test

import (
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy/policytest"
)

// For random configurations, each family's rules hold every entry of that family in the chain's
// order (masqueradeCIDRs, link-local, nonMasqueradeCIDRs, outbound), each pointing back at its
// entry; and Decide is the first match, numbered by its position.
func TestCompileAndDecideRandom(t *testing.T) {
	rank := map[policy.Origin]int{policy.OriginMasqueradeCIDRs: 0, policy.OriginLinkLocal: 1,
		policy.OriginNonMasqueradeCIDRs: 2, policy.OriginOutbound: 3}
	rng := rand.New(rand.NewPCG(3, 4))
	for range 300 {
		cfg := policytest.WithAddresses(rng, policytest.Config(rng, rng.IntN(30)))
		p := policy.Compile(cfg, policy.Options{EnableIPv6: true})
		masq := make([]netip.Prefix, len(cfg.MasqueradeCIDRs))
		for i, m := range cfg.MasqueradeCIDRs {
			masq[i] = m.CIDR
		}
		lists := map[policy.Origin][]netip.Prefix{policy.OriginMasqueradeCIDRs: masq,
			policy.OriginNonMasqueradeCIDRs: cfg.NonMasqueradeCIDRs}
		for _, fam := range policy.Families() {
			rules := p.Rules(fam)
			want := map[policy.Origin]int{}
			for origin, list := range lists {
				for _, c := range list {
					if policy.FamilyOf(c.Addr()) == fam {
						want[origin]++
					}
				}
			}
			got := map[policy.Origin]int{}
			for i, r := range rules {
				got[r.Origin]++
				if r.Family != fam || (i > 0 && rank[rules[i-1].Origin] > rank[r.Origin]) {
					t.Fatalf("config %s: %s rule %d (%s) out of order: %+v", cfg.Canonical(), fam, i+1, r.Source(), rules)
				}
				if list, ok := lists[r.Origin]; ok && list[r.Entry] != r.Prefix {
					t.Fatalf("config %s: %s rule %d says it is %s, which is %s, not %s", cfg.Canonical(), fam, i+1,
						r.Source(), list[r.Entry], r.Prefix)
				}
				// The source address: the entry's own, else the family's masqueradeAddress.
				want := netip.Addr{}
				if r.Action == policy.Masquerade {
					want = p.Address(fam)
				}
				if r.Origin == policy.OriginMasqueradeCIDRs && cfg.MasqueradeCIDRs[r.Entry].Address.IsValid() {
					want = cfg.MasqueradeCIDRs[r.Entry].Address
				}
				if r.Address != want {
					t.Fatalf("config %s: %s rule %d (%s) leaves from %v, want %v", cfg.Canonical(), fam, i+1, r.Source(), r.Address, want)
				}
			}
			for _, origin := range []policy.Origin{policy.OriginMasqueradeCIDRs, policy.OriginNonMasqueradeCIDRs} {
				if got[origin] != want[origin] {
					t.Fatalf("config %s: %d %s rules of %s, want %d", cfg.Canonical(), got[origin], fam, origin, want[origin])
				}
			}
			for range 100 {
				dst := policytest.Destination(rng, p, fam)
				v := p.Decide(dst)
				first := slices.IndexFunc(rules, func(r policy.Rule) bool { return r.Prefix.Contains(dst) })
				if first < 0 {
					if v.Rule != nil || v.Number != 0 || v.Action != policy.Return {
						t.Fatalf("config %s: Decide(%s) = %+v, want the end of the chain", cfg.Canonical(), dst, v)
					}
					continue
				}
				if v.Rule != &rules[first] || v.Number != first+1 || v.Action != rules[first].Action {
					t.Fatalf("config %s: Decide(%s) = %v rule %d, want %v rule %d", cfg.Canonical(), dst, v.Action,
						v.Number, rules[first].Action, first+1)
				}
			}
		}
	}
}
