package iptables

import (
	"context"
	"fmt"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

var _ datapath.DriftChecker = (*Backend)(nil)

// driftKinds are the kinds of drift CheckDrift reports.
var driftKinds = []string{datapath.DriftChain, datapath.DriftJump}

// DriftKinds implements datapath.DriftChecker.
func (b *Backend) DriftKinds() []string { return driftKinds }

// CheckDrift implements datapath.DriftChecker: for each family the last Apply installed, the
// chain and each source rule's chain must hold exactly the rendered lines (so the main chain
// jumps to no chain of a rule that went away), and POSTROUTING exactly one jump to the chain.
// It reads just those chains, without counters (readChains).
func (b *Backend) CheckDrift(ctx context.Context) ([]string, error) {
	var chain, jump bool
	err := b.eachApplied(ctx, func(fam policy.Family, p *policy.Policy, t *tools) error {
		layout := Layout(p, fam, b.chain)
		nat, err := readChains(ctx, b.runner, t, false, layoutChains(layout, "POSTROUTING")...)
		if err != nil {
			return fmt.Errorf("check %s: %w", fam, err)
		}
		jump = jump || countJumps(nat.ChainRules("POSTROUTING"), b.chain) != 1
		chain = chain || !sameLayout(layout, nat)
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []string
	if chain {
		out = append(out, datapath.DriftChain)
	}
	if jump {
		out = append(out, datapath.DriftJump)
	}
	return out, nil
}
