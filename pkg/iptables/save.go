package iptables

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"slices"
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

// SavedRule is one rule line of a dump, parsed once: the rule as text (to compare with a
// rendered Rule and to delete it) and the few options the agent reads from rules it did not
// render.
type SavedRule struct {
	Chain string
	// Spec is the rule after "-A CHAIN ", as iptables-save prints it, without counters.
	Spec string
	// Target is the chain or target the rule jumps or goes to (-j, -g); empty for none.
	Target string
	// Dst is the destination (-d); the zero prefix when the rule has none.
	Dst netip.Prefix
	// Comment is the comment match's text; empty for none.
	Comment string
	// RandomFully is set when the target has the --random-fully option.
	RandomFully bool
	// ToSource is the address SNAT rewrites to (--to-source); invalid for other targets and
	// for a range of addresses.
	ToSource netip.Addr
	// Packets and Bytes are the rule's counters when the dump was made with -c, else zero.
	Packets, Bytes uint64
}

// Text is the rule as iptables-save prints it: "-A CHAIN SPEC".
func (r SavedRule) Text() string {
	if r.Spec == "" {
		return "-A " + r.Chain
	}
	return "-A " + r.Chain + " " + r.Spec
}

// HasChain reports whether the table declares the chain.
func (t *Table) HasChain(name string) bool { return slices.Contains(t.Chains, name) }

// ChainRules returns the rules of one chain, in order.
func (t *Table) ChainRules(chain string) []SavedRule {
	return t.rules(func(r SavedRule) bool { return r.Chain == chain })
}

// SourceChains returns the chains of the main chain's source rules (SourceChain) that the table
// declares or the main chain goes to: in the order the main chain first goes to them, which is
// the order of the rules, then the others in dump order.
func (t *Table) SourceChains(chain string) []string {
	var out []string
	add := func(name string) {
		if isSourceChain(chain, name) && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	for _, r := range t.ChainRules(chain) {
		add(r.Target)
	}
	for _, name := range t.Chains {
		add(name)
	}
	return out
}

// byChain returns the rules of each chain, in order.
func (t *Table) byChain() map[string][]SavedRule {
	out := map[string][]SavedRule{}
	for _, r := range t.Rules {
		out[r.Chain] = append(out[r.Chain], r)
	}
	return out
}

// RulesTargeting returns the rules of any chain that jump or go to the chain.
func (t *Table) RulesTargeting(chain string) []SavedRule {
	return t.rules(func(r SavedRule) bool { return r.Target == chain })
}

// rules returns the rules that keep selects, in dump order.
func (t *Table) rules(keep func(SavedRule) bool) []SavedRule {
	var out []SavedRule
	for _, r := range t.Rules {
		if keep(r) {
			out = append(out, r)
		}
	}
	return out
}

// ParseSave extracts one table from iptables-save output (with or without -c). A table missing
// from the dump is returned empty: iptables-save leaves out tables nothing has used.
func ParseSave(out []byte, table string) (*Table, error) { return parseSave(out, table, nil) }

// parseSave is ParseSave restricted to the named chains (all when chains is nil): the lines of
// other chains are skipped unparsed, which on a node with kube-proxy's rules is nearly all.
func parseSave(out []byte, table string, chains []string) (*Table, error) {
	wanted := func(string) bool { return true }
	if chains != nil {
		wanted = func(c string) bool { return slices.Contains(chains, c) }
	}
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
			if name, _, _ := strings.Cut(line[1:], " "); wanted(name) {
				t.Chains = append(t.Chains, name)
			}
		case !wanted(ruleChain(line)):
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

// ruleChain is the chain of a rule line ("[packets:bytes] -A CHAIN ..."), read without parsing
// the rule; "" when the line is not one.
func ruleChain(line string) string {
	if line[0] == '[' {
		_, line, _ = strings.Cut(line, "] ")
	}
	rest, ok := strings.CutPrefix(line, "-A ")
	if !ok {
		return ""
	}
	chain, _, _ := strings.Cut(rest, " ")
	return chain
}

// parseRuleLine reads "[packets:bytes] -A CHAIN SPEC" (counters optional).
func parseRuleLine(line string) (SavedRule, error) {
	var r SavedRule
	line, err := r.parseCounters(line)
	if err != nil {
		return r, err
	}
	verb, rest, _ := strings.Cut(line, " ")
	chain, spec, _ := strings.Cut(rest, " ")
	if verb != "-A" || chain == "" {
		return r, fmt.Errorf("not a rule: %q", line)
	}
	r.Chain, r.Spec = chain, spec
	args, err := splitArgs(spec)
	if err != nil {
		return r, fmt.Errorf("rule %q: %w", line, err)
	}
	for i, a := range args {
		switch a {
		case "--random-fully":
			r.RandomFully = true
		case "-j", "-g", "-d", "--to-source", "--comment":
			if i+1 == len(args) {
				return r, fmt.Errorf("rule %q: %s without a value", line, a)
			}
			switch a {
			case "-d":
				r.Dst = parseDst(args[i+1])
			case "--to-source":
				r.ToSource = parseToSource(args[i+1])
			case "--comment":
				r.Comment = args[i+1]
			default:
				r.Target = args[i+1]
			}
		}
	}
	return r, nil
}

// parseCounters reads a leading "[packets:bytes] " into r and returns the rest of the line.
func (r *SavedRule) parseCounters(line string) (string, error) {
	if line[0] != '[' {
		return line, nil
	}
	counters, rest, ok := strings.Cut(line[1:], "] ")
	if !ok {
		return "", fmt.Errorf("unterminated counters in %q", line)
	}
	p, b, ok := strings.Cut(counters, ":")
	if !ok {
		return "", fmt.Errorf("malformed counters in %q", line)
	}
	var err error
	if r.Packets, err = strconv.ParseUint(p, 10, 64); err != nil {
		return "", fmt.Errorf("packet counter in %q: %w", line, err)
	}
	if r.Bytes, err = strconv.ParseUint(b, 10, 64); err != nil {
		return "", fmt.Errorf("byte counter in %q: %w", line, err)
	}
	return rest, nil
}

// parseDst reads a -d value: a prefix, or an address (a host); the zero prefix when neither.
func parseDst(v string) netip.Prefix {
	if pr, err := netip.ParsePrefix(v); err == nil {
		return pr
	}
	if addr, err := netip.ParseAddr(v); err == nil {
		return netip.PrefixFrom(addr, addr.BitLen())
	}
	return netip.Prefix{}
}

// parseToSource reads a --to-source value as iptables-save prints it (Rule.toSource): an
// address, with a port range after a colon ("192.0.2.11:40000-40099", "[2001:db8::11]:40000-40099");
// invalid for a range of addresses, which is no one address.
func parseToSource(v string) netip.Addr {
	if addr, err := netip.ParseAddr(v); err == nil {
		return addr // without ports, IPv6 too
	}
	if rest, ok := strings.CutPrefix(v, "["); ok {
		v, _, _ = strings.Cut(rest, "]")
	} else {
		v, _, _ = strings.Cut(v, ":")
	}
	addr, _ := netip.ParseAddr(v)
	return addr
}

// splitArgs splits a rule's options as iptables-save writes them: separated by spaces, a value
// with spaces in double quotes, in which a backslash escapes the next character.
func splitArgs(spec string) ([]string, error) {
	spans, err := scanArgs(spec)
	if err != nil {
		return nil, err
	}
	args := make([]string, len(spans))
	for i, a := range spans {
		args[i] = a.text
	}
	return args, nil
}

// arg is one option of a rule line and where it stands in the line: text is its value (quotes
// and escapes removed), line[start:end] what the line spells.
type arg struct {
	text       string
	start, end int
}

// scanArgs splits a rule line as splitArgs does, keeping where each option stands.
func scanArgs(spec string) ([]arg, error) {
	var args []arg
	for i := 0; i < len(spec); {
		switch spec[i] {
		case ' ':
			i++
		case '"':
			start := i
			var b strings.Builder
			for i++; i < len(spec) && spec[i] != '"'; i++ {
				if spec[i] == '\\' && i+1 < len(spec) {
					i++
				}
				b.WriteByte(spec[i])
			}
			if i == len(spec) {
				return nil, errors.New("unterminated quote")
			}
			i++
			args = append(args, arg{b.String(), start, i})
		default:
			n := strings.IndexByte(spec[i:], ' ')
			if n < 0 {
				n = len(spec) - i
			}
			args = append(args, arg{spec[i : i+n], i, i + n})
			i += n
		}
	}
	return args, nil
}
