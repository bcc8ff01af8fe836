package iptables

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// maxListedChains is the most chains readChains lists one by one.
const maxListedChains = 16

// readChains reads the named nat chains of one mode and family, with their rules' counters when
// counters is set, as cheaply as the mode allows on a node whose nat table holds kube-proxy's
// tens of thousands of rules: the table it returns holds those chains only (HasChain tells which
// exist). A dump of the whole table takes hundreds of milliseconds at 20,000 rules
// (BenchmarkControlPlane).
//
//   - iptables-nft lists one chain (`iptables -t nat -S CHAIN -v`) by asking nf_tables for that
//     chain's rules only: 1.8.9 sends 13 netlink requests and reads 4.5 KB for it, where
//     iptables-nft-save -t nat sends one request per chain (7,285) and reads 13.5 MB (strace,
//     20,000 rules). So each chain is listed on its own.
//   - iptables-legacy has no such request: any listing fetches the whole table from the kernel
//     (IPT_SO_GET_ENTRIES, 12 MB at 20,000 rules, the kernel summing every rule's counters) and
//     that fetch is most of its cost. One chain is listed; two are read from one dump, parsed
//     for those chains only.
//   - Many chains (a policy with source rules) are read from one dump too: each listing is a
//     process of its own, and a few dozen of them cost as much as the dump.
//   - Where the iptables command itself is not installed (only the save and restore tools), the
//     save tool answers.
//
// A chain that iptables fails to list with exit status 1 is taken for missing: that is how both
// modes answer for a chain that does not exist (iptables-nft 1.8.9 saying "chain `X' in table
// `nat' is incompatible", as it does for a chain holding rules it cannot read), while a tool that
// cannot run at all (no permission, the xtables lock) exits 4.
func readChains(ctx context.Context, r Runner, t *tools, counters bool, chains ...string) (*Table, error) {
	if t.list == "" || (t.mode == ModeLegacy && len(chains) > 1) || len(chains) > maxListedChains {
		args := []string{"-t", "nat"}
		if counters {
			args = append(args, "-c")
		}
		out, err := r.Run(ctx, nil, t.save, args...)
		if err != nil {
			return nil, fmt.Errorf("read nat table: %w", err)
		}
		return parseSave(out, "nat", chains)
	}
	nat := &Table{}
	for _, chain := range chains {
		rules, err := listChain(ctx, r, t, chain, counters)
		var ee *ExecError
		if errors.As(err, &ee) && ee.ExitCode() == 1 {
			continue // missing, or not iptables'
		}
		if err != nil {
			return nil, err
		}
		nat.Chains = append(nat.Chains, chain)
		nat.Rules = append(nat.Rules, rules...)
	}
	return nat, nil
}

// listChain returns the rules of one nat chain as iptables-save prints them, with their counters
// when counters is set.
func listChain(ctx context.Context, r Runner, t *tools, chain string, counters bool) ([]SavedRule, error) {
	args := []string{"-t", "nat", "-S", chain}
	if counters {
		args = append(args, "-v")
	}
	if t.atLeast(1, 6, 2) {
		args = append([]string{"--wait"}, args...)
	}
	out, err := r.Run(ctx, nil, t.list, args...)
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
		rl, err := parseListedRule(line, counters)
		if err != nil {
			return nil, fmt.Errorf("%s -S %s: %w", t.list, chain, err)
		}
		rules = append(rules, rl)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read %s -S %s: %w", t.list, chain, err)
	}
	return rules, nil
}

// parseListedRule reads a rule line of `iptables -S`. With -v (counters), iptables puts the
// counters among the options, as "-c PACKETS BYTES" right before the target (-j, -g) or at the
// end of a rule without one: they are taken out, so that the rule reads as iptables-save prints
// it.
func parseListedRule(line string, counters bool) (SavedRule, error) {
	var packets, bytes uint64
	if counters {
		args, err := scanArgs(line)
		if err != nil {
			return SavedRule{}, fmt.Errorf("rule %q: %w", line, err)
		}
		found := false
		// The last "-c N N" outside quotes: any earlier one would be a match's option.
		for i := len(args) - 3; i >= 0 && !found; i-- {
			if args[i].text != "-c" {
				continue
			}
			p, perr := strconv.ParseUint(args[i+1].text, 10, 64)
			b, berr := strconv.ParseUint(args[i+2].text, 10, 64)
			if perr != nil || berr != nil {
				continue
			}
			packets, bytes, found = p, b, true
			end := args[i+2].end
			line = strings.TrimRight(line[:args[i].start], " ") + line[end:]
		}
		if !found {
			return SavedRule{}, fmt.Errorf("rule %q: no counters (-c)", line)
		}
	}
	r, err := parseRuleLine(line)
	r.Packets, r.Bytes = packets, bytes
	return r, err
}
