package iptables

import (
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
)

// ruleLine is the whole vocabulary of a rendered rule: the chain, a prefix, a protocol, a fixed
// comment, the port split's statistic match, the target and its options.
var ruleLine = regexp.MustCompile(`^-A IP-MASQ-AGENT(?: -d (\S+))?(?: -p (?:tcp|udp|sctp))? -m comment --comment "([^"\\]*)"` +
	`(?: -m statistic --mode random --probability 0\.\d{11})? -j (?:MASQUERADE|RETURN)(?: --to-ports \d{1,5}-\d{1,5})?(?: --random-fully)?$`)

// FuzzPayloadFromConfig: whatever document the agent reads, the iptables-restore payload made
// from it consists of the renderer's fixed lines and of rule lines in ruleLine's vocabulary,
// whose prefixes are canonical prefixes the configuration (or the built-in rules) holds and
// whose comments are the fixed ones: no byte of the document reaches iptables unparsed. The
// seeds are injection attempts (iptables arguments, a second COMMIT, quotes, newlines); the
// parser's own corpus (pkg/config FuzzParse) has more.
func FuzzPayloadFromConfig(f *testing.F) {
	for _, doc := range []string{
		`nonMasqueradeCIDRs: ["10.0.0.0/8 -j ACCEPT"]`,
		"nonMasqueradeCIDRs: [\"10.0.0.0/8\\nCOMMIT\\n*filter\\n-A INPUT -j DROP\"]",
		`masqueradeCIDRs: ["1.2.3.0/24\" -j ACCEPT #"]`,
		`nonMasqueradeCIDRs: ["$(reboot)", "10.0.0.0/8; rm -rf /"]`,
		"nonMasqueradeCIDRs:\n  - 10.0.0.0/8 # -j ACCEPT\n  - 192.168.0.0/16\nmasqueradeCIDRs: [10.10.10.0/24]",
		`{"nonMasqueradeCIDRs": ["fd00::/8", "10.0.0.0/8"], "masqOutBoundIPv6": false}`,
		"masqLinkLocal: true\nmasqOutBound: false",
	} {
		f.Add([]byte(doc), true, true)
	}
	ports := policy.PortRanges{{First: 1024, Last: 29999}, {First: 32768, Last: 65535}}
	f.Fuzz(func(t *testing.T, doc []byte, v6, split bool) {
		cfg, err := config.Parse(doc, config.Options{EnableIPv6: v6})
		if err != nil {
			return
		}
		opts := policy.Options{EnableIPv6: v6, RandomFully: true}
		if split {
			opts.ToPorts = ports
		}
		p := policy.Compile(cfg, opts)
		comments := []string{policy.CommentSpecificMasquerade, policy.CommentNonMasquerade, policy.CommentOutbound}
		for _, fam := range policy.Families() {
			if fam == policy.IPv6 && !v6 {
				continue
			}
			known := map[string]bool{}
			for _, r := range p.Rules(fam) {
				known[r.Prefix.String()] = true
			}
			lines := strings.Split(string(Render(p, fam, DefaultChain, true)), "\n")
			head, tail := []string{"*nat", ":IP-MASQ-AGENT - [0:0]"}, []string{JumpRule(DefaultChain).String(), "COMMIT", ""}
			if len(lines) < len(head)+len(tail) || !slices.Equal(lines[:2], head) || !slices.Equal(lines[len(lines)-3:], tail) {
				t.Fatalf("%s payload is not framed as *nat, the chain, rules, the jump, COMMIT:\n%s", fam, strings.Join(lines, "\n"))
			}
			rules := lines[2 : len(lines)-3]
			if want := len(ChainLines(p, fam, DefaultChain)); len(rules) != want {
				t.Fatalf("%s payload has %d rule lines, the policy %d", fam, len(rules), want)
			}
			for _, l := range rules {
				m := ruleLine.FindStringSubmatch(l)
				if m == nil {
					t.Fatalf("%s rule line outside the renderer's vocabulary: %q", fam, l)
				}
				if m[1] == "" { // a rule for every destination (the outbound one, or a /0)
					if all := map[policy.Family]string{policy.IPv4: "0.0.0.0/0", policy.IPv6: "::/0"}[fam]; !known[all] {
						t.Fatalf("%s rule line without a destination, but no %s rule: %q", fam, all, l)
					}
				} else if pr, err := netip.ParsePrefix(m[1]); err != nil || pr.String() != m[1] || pr.Masked() != pr || !known[m[1]] {
					t.Fatalf("%s rule line with prefix %q that the policy does not hold canonically: %q", fam, m[1], l)
				}
				if !slices.Contains(comments, m[2]) {
					t.Fatalf("%s rule line with comment %q: %q", fam, m[2], l)
				}
			}
		}
	})
}
