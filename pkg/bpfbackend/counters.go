package bpfbackend

import (
	"context"
	"net/netip"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// ruleCounters are the rules installed in dp with their counters and masquerade addresses,
// mapped to p's rules by list (the global one or a source rule's), family, prefix, action and
// origin (identical rules in order), in p's order: the global lists' first, then each source
// rule's in rule order; a rule of p not installed (yet) is left out rather than shown as zero.
// With unexplained, the installed rules p lacks follow those of their family with Rule 0: what
// a reader given another configuration (or none, p nil) sees; the agent's backend, whose p is
// the policy it synced, reports p's rules only.
func ruleCounters(ctx context.Context, dp *bpf.Datapath, p *policy.Policy, unexplained bool) ([]datapath.RuleCounter, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	installed, err := dp.InstalledRules()
	if err != nil {
		return nil, err
	}
	type key struct {
		set    string
		fam    policy.Family
		prefix netip.Prefix
		action policy.Action
		origin policy.Origin
		dup    int
	}
	keyOf := func(ir bpf.InstalledRule) key {
		return key{ir.Set, ir.Family, ir.Prefix, ir.Action, ir.Origin, ir.Dup}
	}
	byKey := map[key]bpf.InstalledRule{}
	for _, ir := range installed {
		byKey[keyOf(ir)] = ir
	}
	// explain returns the counters of the rules of one list of p (set: the source rule's name,
	// "" for the global one).
	explain := func(set string, lists *policy.Policy, fam policy.Family) []datapath.RuleCounter {
		var out []datapath.RuleCounter
		seen := map[key]int{}
		for i, rule := range lists.Rules(fam) {
			k := key{set, fam, rule.Prefix, rule.Action, rule.Origin, 0}
			k.dup = seen[k]
			seen[k]++
			ir, ok := byKey[k]
			if !ok {
				continue
			}
			delete(byKey, k)
			out = append(out, datapath.RuleCounter{Set: set, Family: fam, Rule: i + 1, Prefix: rule.Prefix,
				Action: rule.Action, Origin: rule.Origin, Entry: rule.Entry, Address: ir.Address, Packets: ir.Packets, Bytes: ir.Bytes})
		}
		return out
	}
	global := map[policy.Family][]datapath.RuleCounter{}
	var sources []datapath.RuleCounter
	for _, fam := range policy.Families() {
		if p != nil && p.Enabled(fam) {
			global[fam] = explain("", p, fam)
		}
	}
	if p != nil {
		for _, s := range p.Sources {
			for _, fam := range policy.Families() {
				if p.Enabled(fam) {
					sources = append(sources, explain(s.Name, s.Policy, fam)...)
				}
			}
		}
	}
	var out []datapath.RuleCounter
	for _, fam := range policy.Families() {
		out = append(out, global[fam]...)
		if !unexplained {
			continue
		}
		for _, ir := range installed {
			if _, ok := byKey[keyOf(ir)]; !ok || ir.Family != fam {
				continue
			}
			out = append(out, datapath.RuleCounter{Set: ir.Set, Family: fam, Rule: 0, Prefix: ir.Prefix, Action: ir.Action,
				Origin: ir.Origin, Entry: -1, Address: ir.Address, Packets: ir.Packets, Bytes: ir.Bytes})
		}
	}
	return append(out, sources...), nil
}
