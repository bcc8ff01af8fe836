package iptables

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

var _ datapath.DriftChecker = (*Backend)(nil)

// DriftKinds implements datapath.DriftChecker.
func (b *Backend) DriftKinds() []string { return []string{datapath.DriftChain, datapath.DriftJump} }

// CheckDrift implements datapath.DriftChecker: for each family the last Apply installed, the
// chain must hold exactly the rendered lines and POSTROUTING exactly one jump to it.
//
// It lists just those two chains with `iptables -t nat -S CHAIN` rather than dumping the nat
// table as Apply does: on a node with kube-proxy's thousands of nat rules, iptables-nft lists
// one chain in about a millisecond where iptables-nft-save takes over a hundred (7,500 rules
// measured; see the README). iptables-legacy reads the whole table from the kernel either way,
// about 10 ms per listing at that size. Where the iptables command itself is not installed (only
// the save and restore tools), the save tool is used.
func (b *Backend) CheckDrift(ctx context.Context) ([]string, error) {
	var chain, jump bool
	err := b.eachApplied(ctx, func(fam policy.Family, p *policy.Policy, t *tools) error {
		post, err := b.listChain(ctx, t, "POSTROUTING")
		if err != nil {
			return fmt.Errorf("check %s: %w", fam, err)
		}
		jump = jump || countJumps(post, b.chain) != 1
		// POSTROUTING could be listed, so the tool works: a chain it cannot list is missing (or
		// holds what it cannot parse, which is drift just as well).
		live, err := b.listChain(ctx, t, b.chain)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		chain = chain || err != nil || !sameLines(ChainLines(p, fam, b.chain), live)
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

// listChain returns the rules of one nat chain as iptables-save prints them.
func (b *Backend) listChain(ctx context.Context, t *tools, chain string) ([]SavedRule, error) {
	if t.list == "" {
		nat, err := b.save(ctx, t, "-t", "nat")
		if err != nil {
			return nil, err
		}
		if !nat.HasChain(chain) {
			return nil, fmt.Errorf("no chain %s", chain)
		}
		return nat.ChainRules(chain), nil
	}
	args := []string{"-t", "nat", "-S", chain}
	if t.atLeast(1, 6, 2) {
		args = append([]string{"--wait"}, args...)
	}
	out, err := b.runner.Run(ctx, nil, t.list, args...)
	if err != nil {
		return nil, err
	}
	var rules []SavedRule
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "-A ") {
			continue // -N CHAIN, -P CHAIN ACCEPT
		}
		r, err := parseRuleLine(line)
		if err != nil {
			return nil, fmt.Errorf("%s -S %s: %w", t.list, chain, err)
		}
		rules = append(rules, r)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read %s -S %s: %w", t.list, chain, err)
	}
	return rules, nil
}
