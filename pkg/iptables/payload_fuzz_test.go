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

// ruleLine is the whole vocabulary of a rendered rule: the chain (the main one or a source
// rule's), a source prefix, a destination prefix, a protocol, a fixed comment, the port split's
// statistic match, the target and its options.
var ruleLine = regexp.MustCompile(`^-A (IP-MASQ-AGENT(?:-[A-Z2-7]{10})?)(?: -s (\S+))?(?: -d (\S+))?(?: -p (?:tcp|udp|sctp))? -m comment --comment "([^"\\]*)"` +
	`(?: -m statistic --mode random --probability 0\.\d{11})? (?:-j (?:MASQUERADE|RETURN)|-j SNAT --to-source [0-9a-f.:\[\]-]+|-g (IP-MASQ-AGENT-[A-Z2-7]{10}))` +
	`(?: --to-ports \d{1,5}-\d{1,5})?(?: --random-fully)?$`)

// chainLine declares a chain: the main one or a source rule's.
var chainLine = regexp.MustCompile(`^:IP-MASQ-AGENT(?:-[A-Z2-7]{10})? - \[0:0\]$`)

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
		"masqueradeAddress: 192.0.2.1\nsourceRules:\n  - {name: a, cidrs: [10.244.0.0/16, \"fd00::/8\"], nonMasqueradeCIDRs: [10.0.0.0/8], masqueradeAddress: 192.0.2.2}\n  - {name: b, cidrs: [0.0.0.0/0], masqOutBound: false}",
		`sourceRules: [{name: "a\" -j ACCEPT", cidrs: ["10.0.0.0/8 -j ACCEPT"]}]`,
		"sourceRules:\n  - name: x\n    cidrs: [\"10.1.0.0/16\\nCOMMIT\"]",
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
		lists := []*policy.Policy{p}
		comments := []string{policy.CommentSpecificMasquerade, policy.CommentNonMasquerade, policy.CommentOutbound}
		for _, s := range p.Sources {
			lists = append(lists, s.Policy)
			comments = append(comments, SourceJumpComment(s.Name), SourceEndComment(s.Name))
		}
		for _, fam := range policy.Families() {
			if fam == policy.IPv6 && !v6 {
				continue
			}
			known, sources := map[string]bool{}, map[string]bool{}
			for _, l := range lists {
				for _, r := range l.Rules(fam) {
					known[r.Prefix.String()] = true
				}
			}
			for _, s := range p.Sources {
				for _, pr := range s.Prefixes(fam) {
					sources[pr.String()] = true
				}
			}
			layout := Layout(p, fam, DefaultChain)
			lines := strings.Split(string(Render(p, fam, DefaultChain, true)), "\n")
			head, tail := 1+len(layout), []string{JumpRule(DefaultChain).String(), "COMMIT", ""}
			if len(lines) < head+len(tail) || lines[0] != "*nat" || lines[1] != ":IP-MASQ-AGENT - [0:0]" || !slices.Equal(lines[len(lines)-3:], tail) {
				t.Fatalf("%s payload is not framed as *nat, the chains, rules, the jump, COMMIT:\n%s", fam, strings.Join(lines, "\n"))
			}
			declared := map[string]bool{}
			for _, l := range lines[1:head] {
				if !chainLine.MatchString(l) {
					t.Fatalf("%s chain line outside the renderer's vocabulary: %q", fam, l)
				}
				declared[l[1:strings.IndexByte(l, ' ')]] = true
			}
			rules := lines[head : len(lines)-3]
			want := 0
			for _, c := range layout {
				want += len(c.Lines)
			}
			if len(rules) != want {
				t.Fatalf("%s payload has %d rule lines, the policy %d", fam, len(rules), want)
			}
			for _, l := range rules {
				m := ruleLine.FindStringSubmatch(l)
				if m == nil {
					t.Fatalf("%s rule line outside the renderer's vocabulary: %q", fam, l)
				}
				chain, src, dst, comment, gotoChain := m[1], m[2], m[3], m[4], m[5]
				if !declared[chain] || (gotoChain != "" && !declared[gotoChain]) {
					t.Fatalf("%s rule line of or to a chain the payload does not declare: %q", fam, l)
				}
				if src != "" {
					if pr, err := netip.ParsePrefix(src); err != nil || pr.String() != src || pr.Masked() != pr || !sources[src] {
						t.Fatalf("%s rule line with source %q that the policy does not hold canonically: %q", fam, src, l)
					}
				}
				switch {
				case dst != "":
					if pr, err := netip.ParsePrefix(dst); err != nil || pr.String() != dst || pr.Masked() != pr || !known[dst] {
						t.Fatalf("%s rule line with prefix %q that the policy does not hold canonically: %q", fam, dst, l)
					}
				case gotoChain != "" || strings.Contains(comment, "source rule"):
					// A goto to a source rule's chain, or the end of one: no destination.
				default: // a rule for every destination (the outbound one, or a /0)
					if all := map[policy.Family]string{policy.IPv4: "0.0.0.0/0", policy.IPv6: "::/0"}[fam]; !known[all] {
						t.Fatalf("%s rule line without a destination, but no %s rule: %q", fam, all, l)
					}
				}
				if !slices.Contains(comments, comment) {
					t.Fatalf("%s rule line with comment %q: %q", fam, comment, l)
				}
			}
		}
	})
}
