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
// chain must hold exactly the rendered lines and POSTROUTING exactly one jump to it. It reads just
// those two chains, without counters (readChains).
func (b *Backend) CheckDrift(ctx context.Context) ([]string, error) {
	var chain, jump bool
	err := b.eachApplied(ctx, func(fam policy.Family, p *policy.Policy, t *tools) error {
		nat, err := readChains(ctx, b.runner, t, false, "POSTROUTING", b.chain)
		if err != nil {
			return fmt.Errorf("check %s: %w", fam, err)
		}
		jump = jump || countJumps(nat.ChainRules("POSTROUTING"), b.chain) != 1
		chain = chain || !nat.HasChain(b.chain) || !sameLines(ChainLines(p, fam, b.chain), nat.ChainRules(b.chain))
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
