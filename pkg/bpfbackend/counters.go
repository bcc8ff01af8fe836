package bpfbackend

import (
	"context"
	"net/netip"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/bpf"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// ruleCounters are the rules installed in dp with their counters and masquerade addresses,
// mapped to p's rules by family, prefix, action and origin (identical rules in order), in p's
// order; a rule of p not installed (yet) is left out rather than shown as zero. With
// unexplained, the installed rules p lacks follow those of their family with Rule 0: what a
// reader given another configuration (or none, p nil) sees; the agent's backend, whose p is
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
		fam    policy.Family
		prefix netip.Prefix
		action policy.Action
		origin policy.Origin
		dup    int
	}
	byKey := map[key]bpf.InstalledRule{}
	for _, ir := range installed {
		byKey[key{ir.Family, ir.Prefix, ir.Action, ir.Origin, ir.Dup}] = ir
	}
	var out []datapath.RuleCounter
	for _, fam := range policy.Families() {
		if p != nil && p.Enabled(fam) {
			seen := map[key]int{}
			for i, rule := range p.Rules(fam) {
				k := key{fam, rule.Prefix, rule.Action, rule.Origin, 0}
				k.dup = seen[k]
				seen[k]++
				ir, ok := byKey[k]
				if !ok {
					continue
				}
				delete(byKey, k)
				out = append(out, datapath.RuleCounter{Family: fam, Rule: i + 1, Prefix: rule.Prefix,
					Action: rule.Action, Origin: rule.Origin, Entry: rule.Entry, Address: ir.Address, Packets: ir.Packets, Bytes: ir.Bytes})
			}
		}
		if !unexplained {
			continue
		}
		for _, ir := range installed {
			k := key{ir.Family, ir.Prefix, ir.Action, ir.Origin, ir.Dup}
			if _, ok := byKey[k]; !ok || ir.Family != fam {
				continue
			}
			out = append(out, datapath.RuleCounter{Family: fam, Rule: 0, Prefix: ir.Prefix, Action: ir.Action,
				Origin: ir.Origin, Entry: -1, Address: ir.Address, Packets: ir.Packets, Bytes: ir.Bytes})
		}
	}
	return out, nil
}
