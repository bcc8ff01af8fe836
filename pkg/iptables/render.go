// Package iptables renders the policy as an IP-MASQ-AGENT chain and applies it with
// iptables-restore: the fallback datapath for kernels without the BPF features the agent needs.
package iptables

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// DefaultChain is the upstream chain name (--masq-chain).
const DefaultChain = "IP-MASQ-AGENT"

// toPortsProtocols are the protocols MASQUERADE --to-ports (and SNAT's port range) applies to,
// as upstream.
var toPortsProtocols = []string{"tcp", "udp", "sctp"}

var chainNameRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]*$`)

// ValidateChain checks a --masq-chain value: iptables allows at most 28 characters, and the name
// is written into a restore payload, so only plain name characters are accepted.
func ValidateChain(name string) error {
	if len(name) == 0 || len(name) > 28 {
		return fmt.Errorf("masq-chain %q: must be 1 to 28 characters", name)
	}
	if !chainNameRE.MatchString(name) {
		return fmt.Errorf("masq-chain %q: only letters, digits, '_', '.' and '-' are allowed, not first '-' or '.'", name)
	}
	switch name {
	case "PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING":
		return fmt.Errorf("masq-chain %q: is a built-in chain", name)
	}
	return nil
}

// JumpComment is the upstream comment of the POSTROUTING jump.
func JumpComment(chain string) string {
	return fmt.Sprintf("ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom %s chain", chain)
}

// JumpRule is the POSTROUTING rule that sends non-local traffic to the chain.
func JumpRule(chain string) Rule {
	return Rule{Chain: "POSTROUTING", Comment: JumpComment(chain), NotLocal: true, Jump: chain}
}

// Line is one iptables rule of the chain and the policy rule it implements. A MASQUERADE policy
// rule becomes several lines when --to-ports splits it per protocol and port range. One that
// names its source address is an SNAT rule to it, with the same port ranges and random ports.
type Line struct {
	// Policy is the policy rule and Number its 1-based position in its family's list.
	Policy *policy.Rule
	Number int
	Rule   Rule
}

// ChainLines lays out the rule list of a family as the chain's rules.
func ChainLines(p *policy.Policy, fam policy.Family, chain string) []Line {
	rules := p.Rules(fam)
	lines := make([]Line, 0, len(rules))
	for i := range rules {
		pr := &rules[i]
		r := Rule{Chain: chain, Dst: pr.Prefix, Comment: pr.Comment, Jump: TargetReturn}
		if pr.Action == policy.Return {
			lines = append(lines, Line{pr, i + 1, r})
			continue
		}
		r.Jump, r.RandomFully = TargetMasquerade, p.RandomFully
		if pr.Address.IsValid() {
			r.Jump, r.ToSource = TargetSNAT, pr.Address
		}
		if len(p.ToPorts) > 0 {
			for _, proto := range toPortsProtocols {
				left := p.ToPorts.Size()
				for j, ports := range p.ToPorts {
					split := r
					split.Protocol, split.ToPorts = proto, ports
					if j < len(p.ToPorts)-1 {
						// Each range takes its share of the ports not in an earlier range, so
						// every port is equally likely.
						split.Probability = float64(ports.Size()) / float64(left)
					}
					lines = append(lines, Line{pr, i + 1, split})
					left -= ports.Size()
				}
			}
		}
		// Protocols without ports (and every protocol when --to-ports is unset).
		lines = append(lines, Line{pr, i + 1, r})
	}
	return lines
}

// Render returns the iptables-restore payload for one family: the chain declared (which flushes
// it when applied with --noflush), its rules, and the POSTROUTING jump when withJump is set.
// The whole payload is one transaction.
func Render(p *policy.Policy, fam policy.Family, chain string, withJump bool) []byte {
	tx, _ := chainTransaction(ChainLines(p, fam, chain), chain, withJump, nil)
	return tx.Bytes()
}

// RenderKeepingCounters is Render for iptables-restore --counters: every rule line that is
// already installed is prefixed with its live counters ("[packets:bytes] -A ..."), so that the
// rules that stay keep their counts through the flush and refill; new lines start at zero.
// live is the chain as iptables-save -c read it. Each rendered line takes the first unused live
// line with the same text, so identical lines pair up in order, as Counters pairs them. It
// also returns how many lines kept their counters.
func RenderKeepingCounters(p *policy.Policy, fam policy.Family, chain string, withJump bool, live []SavedRule) ([]byte, int) {
	tx, kept := chainTransaction(ChainLines(p, fam, chain), chain, withJump, live)
	return tx.Bytes(), kept
}

// chainTransaction declares (and so flushes) the chain and refills it with lines, each with the
// counters of the live line it pairs with; it also returns how many lines kept counters.
func chainTransaction(lines []Line, chain string, withJump bool, live []SavedRule) (*Transaction, int) {
	tx := NewTransaction()
	tx.Declare(chain)
	pair := newPairing(live)
	kept := 0
	for _, l := range lines {
		spec := l.Rule.Spec()
		var counted *SavedRule
		if j := pair.take(spec); j >= 0 {
			counted = &live[j]
			kept++
		}
		tx.appendSpec(chain, spec, counted)
	}
	if withJump {
		tx.Append(JumpRule(chain))
	}
	return tx, kept
}

// pairing pairs rendered lines with live ones of the same text, each live line at most once,
// in chain order.
type pairing map[string][]int

// newPairing indexes the live lines by text. A map keeps pairing linear; a chain of 100k rules
// replaced by 100k others would otherwise compare every line with every other.
func newPairing(live []SavedRule) pairing {
	byText := make(pairing, len(live))
	for j, r := range live {
		byText[r.Spec] = append(byText[r.Spec], j)
	}
	return byText
}

// take returns the index of the first unused live line with the spec, or -1.
func (p pairing) take(spec string) int {
	js := p[spec]
	if len(js) == 0 {
		return -1
	}
	p[spec] = js[1:]
	return js[0]
}

// RenderAll returns what `render` prints: the IPv4 payload and, when IPv6 is enabled, the IPv6
// payload, each introduced by a comment line naming the command that takes it.
func RenderAll(p *policy.Policy, chain string) string {
	var b strings.Builder
	b.WriteString("# iptables-restore --noflush\n")
	b.Write(Render(p, policy.IPv4, chain, true))
	if p.Enabled(policy.IPv6) {
		b.WriteString("# ip6tables-restore --noflush\n")
		b.Write(Render(p, policy.IPv6, chain, true))
	}
	return b.String()
}
