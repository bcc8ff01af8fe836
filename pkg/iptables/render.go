// Package iptables renders the policy as an IP-MASQ-AGENT chain and applies it with
// iptables-restore: the fallback datapath for kernels without the BPF features the agent needs.
package iptables

import (
	"bytes"
	"fmt"
	"math"
	"regexp"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// DefaultChain is the upstream chain name (--masq-chain).
const DefaultChain = "IP-MASQ-AGENT"

// toPortsProtocols are the protocols MASQUERADE --to-ports applies to, as upstream.
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

// JumpRule is the POSTROUTING rule that sends non-local traffic to the chain, in iptables-save form.
func JumpRule(chain string) string {
	return fmt.Sprintf("-A POSTROUTING -m comment --comment %q -m addrtype ! --dst-type LOCAL -j %s", JumpComment(chain), chain)
}

// Line is one iptables rule of the chain and the policy rule it implements. A MASQUERADE policy
// rule becomes several lines when --to-ports splits it per protocol and port range.
type Line struct {
	Rule *policy.Rule
	// Text is the rule exactly as iptables-save prints it, starting with "-A <chain>".
	Text string
}

// ChainLines renders the rule list of a family, in iptables-save's canonical form so that a
// chain read back from the kernel compares equal line by line.
func ChainLines(p *policy.Policy, fam policy.Family, chain string) []Line {
	rules := p.Rules(fam)
	var lines []Line
	for i := range rules {
		r := &rules[i]
		dst := ""
		if r.Prefix.Bits() > 0 {
			dst = " -d " + r.Prefix.String()
		}
		comment := fmt.Sprintf(" -m comment --comment %q", r.Comment)
		if r.Action == policy.Return {
			lines = append(lines, Line{r, fmt.Sprintf("-A %s%s%s -j RETURN", chain, dst, comment)})
			continue
		}
		masq := " -j MASQUERADE"
		random := ""
		if p.RandomFully {
			random = " --random-fully"
		}
		if len(p.ToPorts) > 0 {
			for _, proto := range toPortsProtocols {
				left := p.ToPorts.Size()
				for j, pr := range p.ToPorts {
					stat := ""
					if j < len(p.ToPorts)-1 {
						stat = " -m statistic --mode random --probability " + probability(pr.Size(), left)
					}
					lines = append(lines, Line{r, fmt.Sprintf("-A %s%s -p %s%s%s%s --to-ports %s%s",
						chain, dst, proto, comment, stat, masq, pr, random)})
					left -= pr.Size()
				}
			}
		}
		// Protocols without ports (and every protocol when --to-ports is unset).
		lines = append(lines, Line{r, fmt.Sprintf("-A %s%s%s%s%s", chain, dst, comment, masq, random)})
	}
	return lines
}

// probability formats n/of the way iptables-save prints the statistic match: the kernel keeps it
// as a 31-bit fraction, and iptables prints that fraction with 11 decimals.
func probability(n, of int) string {
	const scale = 1 << 31
	stored := math.Round(float64(n) / float64(of) * scale)
	return fmt.Sprintf("%.11f", stored/scale)
}

// Render returns the iptables-restore payload for one family: the chain declared (which flushes
// it when applied with --noflush), its rules, and the POSTROUTING jump when withJump is set.
// The whole payload is one transaction.
func Render(p *policy.Policy, fam policy.Family, chain string, withJump bool) []byte {
	return render(ChainLines(p, fam, chain), chain, withJump, nil)
}

// RenderKeepingCounters is Render for iptables-restore --counters: every rule line that is
// already installed is prefixed with its live counters ("[packets:bytes] -A ..."), so that the
// rules that stay keep their counts through the flush and refill; new lines start at zero.
// live is the chain as iptables-save -c read it. Each rendered line takes the first unused live
// line with the same text, so identical lines pair up in order, as Counters pairs them. It
// also returns how many lines kept their counters.
func RenderKeepingCounters(p *policy.Policy, fam policy.Family, chain string, withJump bool, live []SavedRule) ([]byte, int) {
	lines := ChainLines(p, fam, chain)
	match := pairLines(lines, live)
	prefixes := make([]string, len(lines))
	kept := 0
	for i, j := range match {
		if j >= 0 {
			prefixes[i] = fmt.Sprintf("[%d:%d] ", live[j].Packets, live[j].Bytes)
			kept++
		}
	}
	return render(lines, chain, withJump, prefixes), kept
}

// pairLines pairs each rendered line with the first unused live line of the same text: match[i]
// is the index into live of line i's partner, or -1.
func pairLines(lines []Line, live []SavedRule) []int {
	// The live lines of each text, in chain order: pairing takes them from the front. A map
	// keeps this linear; a chain of 100k rules replaced by 100k others would otherwise compare
	// every line with every other.
	byText := make(map[string][]int, len(live))
	for j, r := range live {
		byText[r.Text] = append(byText[r.Text], j)
	}
	match := make([]int, len(lines))
	for i, l := range lines {
		match[i] = -1
		if js := byText[l.Text]; len(js) > 0 {
			match[i], byText[l.Text] = js[0], js[1:]
		}
	}
	return match
}

// render writes the payload; prefixes, when set, go before the rule lines they index.
func render(lines []Line, chain string, withJump bool, prefixes []string) []byte {
	var b bytes.Buffer
	b.WriteString("*nat\n")
	fmt.Fprintf(&b, ":%s - [0:0]\n", chain)
	for i, l := range lines {
		if prefixes != nil {
			b.WriteString(prefixes[i])
		}
		b.WriteString(l.Text)
		b.WriteByte('\n')
	}
	if withJump {
		b.WriteString(JumpRule(chain))
		b.WriteByte('\n')
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
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
