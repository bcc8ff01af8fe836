package policy

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"k8s.io/apimachinery/pkg/labels"
)

// SourceRule is a compiled sourceRules entry: the sources it holds and the rule lists that
// decide their traffic.
type SourceRule struct {
	Name string
	// Index is the rule's position in sourceRules.
	Index int
	// CIDRs are the rule's configured source CIDRs.
	CIDRs []netip.Prefix
	// Selects tells that the rule chooses pods by labels; Pods are the addresses of this
	// node's pods it chooses now (Options.Pods), sorted.
	Selects bool
	Pods    []netip.Addr
	// Policy decides the traffic of the rule's sources: the rule's keys over the global ones.
	// Its rules' Set is Name. Its own Sources are empty; its RandomFully and ToPorts are the
	// global policy's.
	Policy *Policy
	// Config is the sourceRules entry the rule was compiled from (its selectors, for explain;
	// the datapath sees their effect in Pods only, so Equal leaves it out).
	Config config.SourceRule
}

func (s SourceRule) equal(o SourceRule) bool {
	return s.Name == o.Name && s.Index == o.Index && s.Selects == o.Selects && slices.Equal(s.CIDRs, o.CIDRs) &&
		slices.Equal(s.Pods, o.Pods) && s.Policy.Equal(o.Policy)
}

// Prefixes are the rule's sources of a family: its CIDRs, then its pods' addresses as host
// prefixes.
func (s SourceRule) Prefixes(fam Family) []netip.Prefix {
	var out []netip.Prefix
	for _, c := range s.CIDRs {
		if FamilyOf(c.Addr()) == fam {
			out = append(out, c)
		}
	}
	for _, a := range s.Pods {
		if a = a.Unmap(); FamilyOf(a) == fam {
			out = append(out, netip.PrefixFrom(a, a.BitLen()))
		}
	}
	return out
}

// Holds reports whether src is one of the rule's sources.
func (s SourceRule) Holds(src netip.Addr) bool {
	src = src.Unmap()
	for _, p := range s.Prefixes(FamilyOf(src)) {
		if p.Contains(src) {
			return true
		}
	}
	return false
}

// Why tells why the rule holds src: "cidrs[i] PREFIX", or "selects the pod" for a pod address
// of Pods; empty when it does not.
func (s SourceRule) Why(src netip.Addr) string {
	src = src.Unmap()
	for i, c := range s.CIDRs {
		if c.Contains(src) {
			return fmt.Sprintf("cidrs[%d] %s", i, c)
		}
	}
	if slices.Contains(s.Pods, src) {
		return "selects the pod"
	}
	return ""
}

// SelectsPod reports whether the rule's selectors choose a pod of these labels in a namespace
// of these: false for a rule without selectors.
func (s SourceRule) SelectsPod(namespace, pod labels.Labels) bool {
	if !s.Selects {
		return false
	}
	ns, ps := s.Config.Selectors()
	return ns.Matches(namespace) && ps.Matches(pod)
}

// SourceRuleOf returns the source rule that decides traffic from src (the first that holds
// it), or nil: the global lists decide.
func (p *Policy) SourceRuleOf(src netip.Addr) *SourceRule {
	for i := range p.Sources {
		if p.Sources[i].Holds(src) {
			return &p.Sources[i]
		}
	}
	return nil
}

// DecideFrom returns what the datapath does with a new flow from src to dst: the first source
// rule that holds src decides by its lists; without one, the global lists (Decide). This is the
// reference every backend is tested against.
func (p *Policy) DecideFrom(src, dst netip.Addr) Verdict {
	if !p.Enabled(FamilyOf(dst.Unmap())) {
		return p.Decide(dst)
	}
	s := p.SourceRuleOf(src)
	if s == nil {
		return p.Decide(dst)
	}
	return s.Decide(dst)
}

// Decide is the verdict of the rule's lists for traffic from one of its sources to dst.
func (s *SourceRule) Decide(dst netip.Addr) Verdict {
	v := s.Policy.Decide(dst)
	v.SourceRule = s
	if v.Rule == nil {
		v.Reason = fmt.Sprintf("source rule %s: %s", s.Name, v.Reason)
	}
	return v
}

// SourceEntry is one entry of a family's source table: a source prefix and the source rule
// (an index into Sources) that decides its addresses.
type SourceEntry struct {
	Prefix netip.Prefix
	Rule   int
}

// SourceTable returns a family's sources as a longest-prefix-match table that gives first-match
// answers: for every address, the longest entry that holds it names the first rule that holds
// it. Each prefix of a rule appears once, named for the first rule whose sources hold all of it
// (a later rule's prefix inside an earlier rule's names the earlier). Sorted by prefix.
func (p *Policy) SourceTable(fam Family) []SourceEntry {
	var all []SourceEntry
	for i, s := range p.Sources {
		for _, pre := range s.Prefixes(fam) {
			all = append(all, SourceEntry{Prefix: pre, Rule: i})
		}
	}
	// By prefix length, shortest first, so that every prefix that holds another comes before it.
	slices.SortStableFunc(all, func(a, b SourceEntry) int { return cmp.Compare(a.Prefix.Bits(), b.Prefix.Bits()) })
	out := make([]SourceEntry, 0, len(all))
	seen := make(map[netip.Prefix]int, len(all))
	for _, e := range all {
		rule := e.Rule
		// The prefixes that hold e are among those before it: the addresses of e's longest
		// match are held by each of them.
		for bits := e.Prefix.Bits(); bits >= 0; bits-- {
			outer, _ := e.Prefix.Addr().Prefix(bits)
			if j, ok := seen[outer]; ok {
				rule = min(rule, out[j].Rule)
			}
		}
		if j, ok := seen[e.Prefix]; ok {
			out[j].Rule = min(out[j].Rule, rule)
			continue
		}
		seen[e.Prefix] = len(out)
		out = append(out, SourceEntry{Prefix: e.Prefix, Rule: rule})
	}
	slices.SortFunc(out, func(a, b SourceEntry) int {
		if c := a.Prefix.Addr().Compare(b.Prefix.Addr()); c != 0 {
			return c
		}
		return cmp.Compare(a.Prefix.Bits(), b.Prefix.Bits())
	})
	return out
}
