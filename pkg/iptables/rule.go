package iptables

import (
	"bytes"
	"fmt"
	"math"
	"net/netip"
	"strconv"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// Targets the agent's rules use besides its own chain.
const (
	TargetReturn     = "RETURN"
	TargetMasquerade = "MASQUERADE"
	// TargetSNAT rewrites to a given source address (--to-source): a masquerade rule of the
	// policy that names its address.
	TargetSNAT = "SNAT"
)

// Rule is one iptables rule of the nat table as data. Its options are written in one place
// (Spec), in the order iptables-save prints them, so that a rule read back from the kernel
// compares equal to the rendered one as text.
type Rule struct {
	Chain string
	// Src and Dst are the source (-s) and destination (-d). A zero or /0 prefix matches every
	// address and is not written, as iptables-save leaves it out.
	Src, Dst netip.Prefix
	// Protocol is -p; empty for every protocol.
	Protocol string
	// Comment is the comment match's text; empty for none.
	Comment string
	// Probability, when above zero, adds a random statistic match: the rule matches that share
	// of the packets that reach it (the kernel keeps it as a 31-bit fraction).
	Probability float64
	// NotLocal matches destinations that are not the node's own (addrtype ! --dst-type LOCAL).
	NotLocal bool
	// Jump is the target: TargetReturn, TargetMasquerade, TargetSNAT or a chain.
	Jump string
	// Goto goes to the chain Jump names (-g) instead of jumping to it (-j): a RETURN there, or
	// its end, leaves the calling chain too, as if that had returned.
	Goto bool
	// ToSource is SNAT's address.
	ToSource netip.Addr
	// ToPorts and RandomFully are the options of MASQUERADE and SNAT; a zero ToPorts keeps the
	// source port.
	ToPorts     policy.PortRange
	RandomFully bool
}

// appendArgs appends the rule's options to a, in iptables-save's order, as the arguments of
// an iptables command.
func (r Rule) appendArgs(a []string) []string {
	if r.Src.Bits() > 0 {
		a = append(a, "-s", r.Src.String())
	}
	if r.Dst.Bits() > 0 {
		a = append(a, "-d", r.Dst.String())
	}
	if r.Protocol != "" {
		a = append(a, "-p", r.Protocol)
	}
	if r.Comment != "" {
		a = append(a, "-m", "comment", "--comment", r.Comment)
	}
	if r.Probability > 0 {
		a = append(a, "-m", "statistic", "--mode", "random", "--probability", formatProbability(r.Probability))
	}
	if r.NotLocal {
		a = append(a, "-m", "addrtype", "!", "--dst-type", "LOCAL")
	}
	if r.Goto {
		a = append(a, "-g", r.Jump)
	} else {
		a = append(a, "-j", r.Jump)
	}
	switch {
	case r.ToSource.IsValid():
		a = append(a, "--to-source", r.toSource())
	case r.ToPorts != (policy.PortRange{}):
		a = append(a, "--to-ports", r.ToPorts.String())
	}
	if r.RandomFully {
		a = append(a, "--random-fully")
	}
	return a
}

// toSource is SNAT's --to-source value as iptables-save prints it: the address, with the port
// range after a colon ("10.0.0.11:40000-40099", "[2001:db8::11]:40000-40099").
func (r Rule) toSource() string {
	if r.ToPorts == (policy.PortRange{}) {
		return r.ToSource.String()
	}
	if r.ToSource.Is6() {
		return "[" + r.ToSource.String() + "]:" + r.ToPorts.String()
	}
	return r.ToSource.String() + ":" + r.ToPorts.String()
}

// Args are the rule's options as the arguments of an iptables command (-A CHAIN ARGS...).
func (r Rule) Args() []string { return r.appendArgs(nil) }

// Spec is the rule after "-A CHAIN ", as iptables-save prints it: the options of Args, the
// comment quoted.
func (r Rule) Spec() string {
	var buf [24]string // more than the longest rule has; a chain of 100k rules renders each
	args := r.appendArgs(buf[:0])
	n := len(args) + 2
	for _, a := range args {
		n += len(a)
	}
	var b strings.Builder
	b.Grow(n)
	for i, a := range args {
		if i > 0 {
			b.WriteByte(' ')
		}
		if i > 0 && args[i-1] == "--comment" {
			writeQuoted(&b, a)
		} else {
			b.WriteString(a)
		}
	}
	return b.String()
}

// writeQuoted writes s in double quotes, escaped as Go (and iptables) escape it.
func writeQuoted(b *strings.Builder, s string) {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < ' ' || c > '~' || c == '"' || c == '\\' {
			b.WriteString(strconv.Quote(s))
			return
		}
	}
	// Plain printable ASCII, as every comment the agent writes: no escapes needed.
	b.WriteByte('"')
	b.WriteString(s)
	b.WriteByte('"')
}

// String is the rule as iptables-save prints it: "-A CHAIN SPEC".
func (r Rule) String() string { return "-A " + r.Chain + " " + r.Spec() }

// formatProbability writes p the way iptables-save prints the statistic match: rounded to the
// kernel's 31-bit fraction, with 11 decimals.
func formatProbability(p float64) string {
	const scale = 1 << 31
	return fmt.Sprintf("%.11f", math.Round(p*scale)/scale)
}

// Transaction is one iptables-restore --noflush transaction on the nat table: the only place a
// payload is written. It applies whole or not at all.
type Transaction struct {
	b         bytes.Buffer
	committed bool
}

// NewTransaction starts a transaction on the nat table.
func NewTransaction() *Transaction {
	tx := &Transaction{}
	tx.b.WriteString("*nat\n")
	return tx
}

// Declare names a chain: with --noflush it creates the chain, or flushes it when it exists.
func (tx *Transaction) Declare(chain string) { fmt.Fprintf(&tx.b, ":%s - [0:0]\n", chain) }

// Append adds a rule at the end of its chain.
func (tx *Transaction) Append(r Rule) { tx.line("", "-A", r.Chain, r.Spec()) }

// appendSpec adds a rendered rule, with its counters when counted is set (restore --counters
// takes them; without it they are ignored).
func (tx *Transaction) appendSpec(chain, spec string, counted *SavedRule) {
	prefix := ""
	if counted != nil {
		prefix = fmt.Sprintf("[%d:%d] ", counted.Packets, counted.Bytes)
	}
	tx.line(prefix, "-A", chain, spec)
}

// Delete removes the first rule of the chain equal to r.
func (tx *Transaction) Delete(r Rule) { tx.line("", "-D", r.Chain, r.Spec()) }

// DeleteSaved removes a rule as a dump showed it.
func (tx *Transaction) DeleteSaved(r SavedRule) { tx.line("", "-D", r.Chain, r.Spec) }

// DeleteChain removes a chain, which must be empty and unreferenced by then; declaring it
// first (Declare) flushes it, and makes the removal valid when it did not exist.
func (tx *Transaction) DeleteChain(chain string) { fmt.Fprintf(&tx.b, "-X %s\n", chain) }

func (tx *Transaction) line(prefix, verb, chain, spec string) {
	tx.b.WriteString(prefix)
	tx.b.WriteString(verb)
	tx.b.WriteByte(' ')
	tx.b.WriteString(chain)
	if spec != "" {
		tx.b.WriteByte(' ')
		tx.b.WriteString(spec)
	}
	tx.b.WriteByte('\n')
}

// Bytes returns the payload, committed: nothing may be added after.
func (tx *Transaction) Bytes() []byte {
	if !tx.committed {
		tx.b.WriteString("COMMIT\n")
		tx.committed = true
	}
	return tx.b.Bytes()
}
