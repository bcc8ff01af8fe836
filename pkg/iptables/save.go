package iptables

import (
	"bufio"
	"bytes"
	"fmt"
	"strconv"
	"strings"
)

// Table is one table of an iptables-save dump.
type Table struct {
	// Chains are the chains the table declares, built-in ones included, in dump order.
	Chains []string
	// Rules are the table's rules in dump order; each chain's rules keep their order.
	Rules []SavedRule
}

// SavedRule is one rule line of a dump.
type SavedRule struct {
	Chain string
	// Text is the rule as iptables-save prints it, starting with "-A <chain>", without counters.
	Text string
	// Packets and Bytes are the rule's counters when the dump was made with -c, else zero.
	Packets, Bytes uint64
}

// HasChain reports whether the table declares the chain.
func (t *Table) HasChain(name string) bool {
	for _, c := range t.Chains {
		if c == name {
			return true
		}
	}
	return false
}

// ChainRules returns the rules of one chain, in order.
func (t *Table) ChainRules(chain string) []SavedRule {
	var out []SavedRule
	for _, r := range t.Rules {
		if r.Chain == chain {
			out = append(out, r)
		}
	}
	return out
}

// RulesTargeting returns the rules of any chain that jump or go to the chain.
func (t *Table) RulesTargeting(chain string) []SavedRule {
	var out []SavedRule
	for _, r := range t.Rules {
		f := strings.Fields(r.Text)
		for i := 0; i+1 < len(f); i++ {
			if (f[i] == "-j" || f[i] == "-g") && f[i+1] == chain {
				out = append(out, r)
				break
			}
		}
	}
	return out
}

// ParseSave extracts one table from iptables-save output (with or without -c). A table missing
// from the dump is returned empty: iptables-save leaves out tables nothing has used.
func ParseSave(out []byte, table string) (*Table, error) {
	t := &Table{}
	in := false
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch {
		case line == "" || line[0] == '#':
		case line[0] == '*':
			in = line[1:] == table
		case !in:
		case line == "COMMIT":
			in = false
		case line[0] == ':':
			name, _, _ := strings.Cut(line[1:], " ")
			t.Chains = append(t.Chains, name)
		default:
			r, err := parseRuleLine(line)
			if err != nil {
				return nil, fmt.Errorf("iptables-save output line %d: %w", n, err)
			}
			t.Rules = append(t.Rules, r)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read iptables-save output: %w", err)
	}
	return t, nil
}

func parseRuleLine(line string) (SavedRule, error) {
	var r SavedRule
	if line[0] == '[' {
		counters, rest, ok := strings.Cut(line[1:], "] ")
		if !ok {
			return r, fmt.Errorf("unterminated counters in %q", line)
		}
		p, b, ok := strings.Cut(counters, ":")
		if !ok {
			return r, fmt.Errorf("malformed counters in %q", line)
		}
		var err error
		if r.Packets, err = strconv.ParseUint(p, 10, 64); err != nil {
			return r, fmt.Errorf("packet counter in %q: %w", line, err)
		}
		if r.Bytes, err = strconv.ParseUint(b, 10, 64); err != nil {
			return r, fmt.Errorf("byte counter in %q: %w", line, err)
		}
		line = rest
	}
	f := strings.Fields(line)
	if len(f) < 2 || f[0] != "-A" {
		return r, fmt.Errorf("not a rule: %q", line)
	}
	r.Chain, r.Text = f[1], line
	return r, nil
}
