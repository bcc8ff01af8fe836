// Package iptables renders the policy as an IP-MASQ-AGENT chain and applies it with
// iptables-restore: the fallback datapath for kernels without the BPF features the agent needs.
package iptables

import (
	"crypto/sha256"
	"encoding/base32"
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

// Line is one iptables rule of a chain and the policy rule it implements. A MASQUERADE policy
// rule becomes several lines when --to-ports splits it per protocol and port range. One that
// names its source address is an SNAT rule to it, with the same port ranges and random ports.
type Line struct {
	// Policy is the policy rule and Number its 1-based position in its list; Policy is nil for
	// the lines that lead packets between the chains (a source rule's jumps, the RETURN that
	// ends its chain), which implement no rule of a list.
	Policy *policy.Rule
	Number int
	Rule   Rule
}

// ChainLines lays out the global rule list of a family as the chain's rules.
func ChainLines(p *policy.Policy, fam policy.Family, chain string) []Line {
	return appendListLines(make([]Line, 0, len(p.Rules(fam))), p, fam, chain)
}

// appendListLines appends the lines of p's rule list of a family, in chain.
func appendListLines(lines []Line, p *policy.Policy, fam policy.Family, chain string) []Line {
	rules := p.Rules(fam)
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

// Chain is one chain of a family's layout: its name, the source rule whose list it holds (nil
// for the main chain) and its lines.
type Chain struct {
	Name   string
	Source *policy.SourceRule
	Lines  []Line
}

// Layout lays out a family's policy as chains, main chain first. The main chain starts with
// each source rule's jumps (-s PREFIX -g its chain), rules in order: iptables takes the first
// match, so the first rule that holds a source decides it, as policy.DecideFrom. The global
// list follows, for the sources no rule holds. Each source rule that holds sources of the
// family has a chain of its own (SourceChain): its list, then a RETURN for the rest. So every
// source chain is one the main chain goes to, and the chains of rules that went away are found
// through it. The jumps are gotos: a RETURN in a chain entered with -j would resume the main
// chain after the jump, where the global rules would decide after all; from a chain entered
// with -g it returns to POSTROUTING, which jumped to the main chain, as a RETURN of the main
// chain does. A family the policy does not enable has an empty main chain only.
func Layout(p *policy.Policy, fam policy.Family, chain string) []Chain {
	if !p.Enabled(fam) || len(p.Sources) == 0 {
		return []Chain{{Name: chain, Lines: ChainLines(p, fam, chain)}}
	}
	chains := make([]Chain, 1, 1+len(p.Sources))
	var jumps []Line
	for i := range p.Sources {
		s := &p.Sources[i]
		sources := s.Prefixes(fam)
		if len(sources) == 0 {
			continue
		}
		name := SourceChain(chain, s.Name)
		for _, src := range sources {
			jumps = append(jumps, Line{Rule: Rule{Chain: chain, Src: src, Comment: SourceJumpComment(s.Name), Jump: name, Goto: true}})
		}
		list := sourceList(p, s)
		lines := appendListLines(make([]Line, 0, len(list.Rules(fam))+1), list, fam, name)
		lines = append(lines, Line{Rule: Rule{Chain: name, Comment: SourceEndComment(s.Name), Jump: TargetReturn}})
		chains = append(chains, Chain{Name: name, Source: s, Lines: lines})
	}
	chains[0] = Chain{Name: chain, Lines: appendListLines(jumps, p, fam, chain)}
	return chains
}

// sourceList is a source rule's policy with the NAT settings of the policy it is part of: the
// backend drops --random-fully from the whole policy where the node lacks it.
func sourceList(p *policy.Policy, s *policy.SourceRule) *policy.Policy {
	list := *s.Policy
	list.RandomFully, list.ToPorts = p.RandomFully, p.ToPorts
	return &list
}

// sourceHashLen is how many characters of a hash of the rule name end a source chain's name:
// 50 bits, so that a thousand rules (config.MaxSourceRules) share none by chance.
const sourceHashLen = 10

// maxChainLen is iptables' limit on a chain name.
const maxChainLen = 28

const sourceHashAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"

var sourceHash = base32.NewEncoding(sourceHashAlphabet).WithPadding(base32.NoPadding)

// sourceChainPrefix is how every source chain of the main chain begins: the main chain's name,
// cut where needed to leave room for the hash within iptables' limit.
func sourceChainPrefix(chain string) string {
	return chain[:min(len(chain), maxChainLen-1-sourceHashLen)] + "-"
}

// SourceChain is the name of the chain that holds a source rule's list: derived from the main
// chain (--masq-chain) and the rule's name, which may be longer than a chain name can be, by a
// hash. A rule keeps its chain, and so its counters, wherever it moves in the list.
func SourceChain(chain, rule string) string {
	sum := sha256.Sum256([]byte(chain + "\x00" + rule))
	return sourceChainPrefix(chain) + sourceHash.EncodeToString(sum[:])[:sourceHashLen]
}

// isSourceChain reports whether name has the form of a source chain of the main chain: how
// Cleanup finds them without knowing the rules' names.
func isSourceChain(chain, name string) bool {
	hash, ok := strings.CutPrefix(name, sourceChainPrefix(chain))
	// A main chain of 28 characters may have the form itself.
	if !ok || len(hash) != sourceHashLen || name == chain {
		return false
	}
	for _, c := range hash {
		if !strings.ContainsRune(sourceHashAlphabet, c) {
			return false
		}
	}
	return true
}

// Comment texts of the lines that lead packets to a source rule's chain and end it. Both name
// the rule: a dump reads its name back from them.
const (
	sourceJumpPrefix = "ip-masq-agent: traffic from the sources of source rule "
	sourceJumpSuffix = " is decided by its chain"
	sourceEndPrefix  = "ip-masq-agent: the rest of the traffic of source rule "
	sourceEndSuffix  = " is not subject to MASQUERADE (must be last in chain)"
)

// SourceJumpComment is the comment of a source rule's jumps from the main chain.
func SourceJumpComment(rule string) string { return sourceJumpPrefix + rule + sourceJumpSuffix }

// SourceEndComment is the comment of the RETURN that ends a source rule's chain.
func SourceEndComment(rule string) string { return sourceEndPrefix + rule + sourceEndSuffix }

// sourceRuleOf reads the source rule's name back from the comment of a jump or of the end of
// its chain; "" for another comment.
func sourceRuleOf(comment string) string {
	for _, c := range [][2]string{{sourceJumpPrefix, sourceJumpSuffix}, {sourceEndPrefix, sourceEndSuffix}} {
		if rest, ok := strings.CutPrefix(comment, c[0]); ok {
			if name, ok := strings.CutSuffix(rest, c[1]); ok && name != "" {
				return name
			}
		}
	}
	return ""
}

// Render returns the iptables-restore payload for one family: the chains of its layout declared
// (which flushes them when applied with --noflush), their rules, and the POSTROUTING jump when
// withJump is set. The whole payload is one transaction.
func Render(p *policy.Policy, fam policy.Family, chain string, withJump bool) []byte {
	tx, _ := layoutTransaction(Layout(p, fam, chain), withJump, nil, nil)
	return tx.Bytes()
}

// RenderKeepingCounters is Render for iptables-restore --counters: every rule line that is
// already installed is prefixed with its live counters ("[packets:bytes] -A ..."), so that the
// rules that stay keep their counts through the flush and refill; new lines start at zero.
// live are the layout's chains as iptables-save -c read them. Each rendered line takes the
// first unused live line of its chain with the same text, so identical lines pair up in
// order, as Counters pairs them. It also returns how many lines kept their counters.
func RenderKeepingCounters(p *policy.Policy, fam policy.Family, chain string, withJump bool, live []SavedRule) ([]byte, int) {
	tx, kept := layoutTransaction(Layout(p, fam, chain), withJump, live, nil)
	return tx.Bytes(), kept
}

// layoutTransaction declares (and so flushes) the layout's chains and refills them, each line
// with the counters of the live line it pairs with; then it adds the POSTROUTING jump when
// withJump is set, and flushes and removes the stale chains, which the main chain no longer
// jumps to once refilled. It also returns how many lines kept counters.
func layoutTransaction(chains []Chain, withJump bool, live []SavedRule, stale []string) (*Transaction, int) {
	tx := NewTransaction()
	for _, c := range chains {
		tx.Declare(c.Name)
	}
	pair := newPairing(live)
	kept := 0
	for _, c := range chains {
		for _, l := range c.Lines {
			spec := l.Rule.Spec()
			var counted *SavedRule
			if j := pair.take(c.Name, spec); j >= 0 {
				counted = &live[j]
				kept++
			}
			tx.appendSpec(c.Name, spec, counted)
		}
	}
	if withJump {
		tx.Append(JumpRule(chains[0].Name))
	}
	for _, name := range stale {
		tx.Declare(name)
		tx.DeleteChain(name)
	}
	return tx, kept
}

// pairing pairs rendered lines with live ones of the same chain and text, each live line at
// most once, in chain order.
type pairing map[pairKey][]int

type pairKey struct{ chain, spec string }

// newPairing indexes the live lines by chain and text. A map keeps pairing linear; a chain of
// 100k rules replaced by 100k others would otherwise compare every line with every other.
func newPairing(live []SavedRule) pairing {
	byText := make(pairing, len(live))
	for j, r := range live {
		k := pairKey{r.Chain, r.Spec}
		byText[k] = append(byText[k], j)
	}
	return byText
}

// take returns the index of the first unused live line of the chain with the spec, or -1.
func (p pairing) take(chain, spec string) int {
	k := pairKey{chain, spec}
	js := p[k]
	if len(js) == 0 {
		return -1
	}
	p[k] = js[1:]
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
