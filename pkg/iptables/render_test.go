package iptables

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/internal/testutil"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy/policytest"
)

// listedRule is one row of `iptables -L`: what the seeds show.
type listedRule struct {
	target, destination, comment string
}

func (r listedRule) String() string {
	return fmt.Sprintf("%-10s %-18s %s", r.target, r.destination, r.comment)
}

var commentRE = regexp.MustCompile(`/\* (.*?) \*/`)

// parseListing reads an `iptables -L [-v] [-n]` listing of one chain.
func parseListing(t *testing.T, text string) []listedRule {
	t.Helper()
	var rules []listedRule
	targetCol, destCol := -1, -1
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || fields[0] == "Chain" {
			continue
		}
		if targetCol < 0 {
			for i, f := range fields {
				switch f {
				case "target":
					targetCol = i
				case "destination":
					destCol = i
				}
			}
			continue
		}
		r := listedRule{target: fields[targetCol], destination: fields[destCol]}
		if m := commentRE.FindStringSubmatch(sc.Text()); m != nil {
			r.comment = m[1]
		}
		rules = append(rules, r)
	}
	return rules
}

// listed converts rendered lines to what `iptables -L -n` shows for them.
func listed(lines []Line) []listedRule {
	var rules []listedRule
	for _, l := range lines {
		r := listedRule{target: l.Rule.Jump, destination: "0.0.0.0/0", comment: l.Policy.Comment}
		if l.Policy.Family == policy.IPv6 {
			r.destination = "::/0"
		}
		if l.Rule.Dst.Bits() > 0 {
			r.destination = strings.TrimSuffix(strings.TrimSuffix(l.Rule.Dst.String(), "/32"), "/128")
		}
		rules = append(rules, r)
	}
	return rules
}

func loadSeedPolicy(t *testing.T, name string, opts policy.Options) *policy.Policy {
	t.Helper()
	cfg, err := config.Load(filepath.Join("testdata", "seeds", name), config.Options{EnableIPv6: opts.EnableIPv6})
	if err != nil {
		t.Fatal(err)
	}
	return policy.Compile(cfg, opts)
}

func readSeedChain(t *testing.T, name string) []listedRule {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "seeds", name))
	if err != nil {
		t.Fatal(err)
	}
	return parseListing(t, string(b))
}

func diffRules(t *testing.T, got, want []listedRule) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("got %d rules, want %d", len(got), len(want))
	}
	for i := range max(len(got), len(want)) {
		var g, w listedRule
		if i < len(got) {
			g = got[i]
		}
		if i < len(want) {
			w = want[i]
		}
		if g != w {
			t.Errorf("rule %d:\n got  %v\n want %v", i+1, g, w)
		}
	}
}

var seedScenarios = []string{"cce-pod-identity", "cce-node-identity", "cce-some-destinations"}

// The CCE seed's three scenarios, written as config files, render the seed's chains:
// same targets, destinations, comments, in the same order.
func TestSeedScenariosRenderSeedChains(t *testing.T) {
	for _, name := range seedScenarios {
		t.Run(name, func(t *testing.T) {
			// The seeds' configs hold fc00::/7, so they need --enable-ipv6, and the agent's
			// defaults are on (random-fully does not show in the target/destination/comment columns).
			p := loadSeedPolicy(t, name+".yaml", policy.Options{EnableIPv6: true, RandomFully: true})
			diffRules(t, listed(ChainLines(p, policy.IPv4, DefaultChain)), readSeedChain(t, name+".chain"))
		})
	}
}

// The defaults render the chain of the handbook seed. That listing comes from an older upstream
// release whose comments read "cluster-local traffic should not be subject to MASQUERADE" and
// which repeated `ADDRTYPE match dst-type !LOCAL` on every rule; the current upstream (and the
// CCE seed) keep the addrtype match on the POSTROUTING jump and use the newer comment texts.
// So targets, destinations and order must match; comments are the current texts.
func TestDefaultsRenderHandbookChain(t *testing.T) {
	cfg := config.Default(config.Options{})
	p := policy.Compile(cfg, policy.Options{RandomFully: true})
	got := listed(ChainLines(p, policy.IPv4, DefaultChain))
	want := readSeedChain(t, "handbook-defaults.chain")
	for i := range want {
		if want[i].destination == "anywhere" {
			want[i].destination = "0.0.0.0/0"
		}
		want[i].comment = strings.NewReplacer(
			"cluster-local traffic should not be subject to MASQUERADE", "local traffic is not subject to MASQUERADE",
			"outbound traffic should be subject to MASQUERADE (this match must come after cluster-local CIDR matches)",
			"outbound traffic is subject to MASQUERADE (must be last in chain)",
		).Replace(want[i].comment)
	}
	diffRules(t, got, want)
	if !strings.Contains(JumpRule(DefaultChain).String(), "-m addrtype ! --dst-type LOCAL -j IP-MASQ-AGENT") {
		t.Errorf("jump %q does not exclude LOCAL destinations", JumpRule(DefaultChain).String())
	}
}

func TestRenderPayload(t *testing.T) {
	p := loadSeedPolicy(t, "cce-some-destinations.yaml", policy.Options{EnableIPv6: true, RandomFully: true})
	want := `*nat
:IP-MASQ-AGENT - [0:0]
-A IP-MASQ-AGENT -d 10.10.10.10/32 -m comment --comment "ip-masq-agent: specific outbound traffic is subject to MASQUERADE" -j MASQUERADE --random-fully
-A IP-MASQ-AGENT -d 169.254.0.0/16 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN
-A IP-MASQ-AGENT -d 10.0.0.0/8 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN
-A IP-MASQ-AGENT -d 172.16.0.0/12 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN
-A IP-MASQ-AGENT -d 100.64.230.0/24 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN
-A IP-MASQ-AGENT -d 192.168.0.0/16 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN
-A POSTROUTING -m comment --comment "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom IP-MASQ-AGENT chain" -m addrtype ! --dst-type LOCAL -j IP-MASQ-AGENT
COMMIT
`
	if got := string(Render(p, policy.IPv4, DefaultChain, true)); got != want {
		t.Errorf("IPv4 payload:\n%s\nwant:\n%s", got, want)
	}
	want6 := `*nat
:IP-MASQ-AGENT - [0:0]
-A IP-MASQ-AGENT -d fe80::/10 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN
-A IP-MASQ-AGENT -d fc00::/7 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -j MASQUERADE --random-fully
COMMIT
`
	if got := string(Render(p, policy.IPv6, DefaultChain, false)); got != want6 {
		t.Errorf("IPv6 payload:\n%s\nwant:\n%s", got, want6)
	}
	all := RenderAll(p, "MY-CHAIN")
	if !strings.Contains(all, "# ip6tables-restore --noflush\n*nat\n:MY-CHAIN - [0:0]\n") ||
		strings.Count(all, "-j MY-CHAIN") != 2 || strings.Count(all, "COMMIT") != 2 {
		t.Errorf("RenderAll:\n%s", all)
	}
	p.IPv6 = nil
	if all := RenderAll(p, DefaultChain); strings.Contains(all, "ip6tables") {
		t.Errorf("RenderAll without IPv6 has an IPv6 part:\n%s", all)
	}
}

func TestRenderWithoutRandomFully(t *testing.T) {
	p := policy.Compile(config.Default(config.Options{}), policy.Options{RandomFully: false})
	if out := string(Render(p, policy.IPv4, DefaultChain, false)); strings.Contains(out, "random-fully") ||
		!strings.Contains(out, "-j MASQUERADE\n") {
		t.Errorf("payload:\n%s", out)
	}
}

// --to-ports splits each MASQUERADE rule per protocol and range, with statistic probabilities
// that make every port equally likely, as upstream does; other protocols keep a plain rule.
func TestRenderToPorts(t *testing.T) {
	ports, err := policy.ParsePortRanges("1024-29999,32768-65535")
	if err != nil {
		t.Fatal(err)
	}
	cfg := config.Default(config.Options{})
	cfg.MasqueradeCIDRs = []config.MasqueradeCIDR{{CIDR: netip.MustParsePrefix("10.10.10.10/32")}}
	p := policy.Compile(cfg, policy.Options{RandomFully: true, ToPorts: ports})
	lines := ChainLines(p, policy.IPv4, DefaultChain)
	// 1 masquerade CIDR + outbound, each 3 protocols x 2 ranges + 1 plain; 4 RETURN rules.
	if len(lines) != 2*7+4 {
		t.Fatalf("got %d lines", len(lines))
	}
	const c = `-m comment --comment "ip-masq-agent: specific outbound traffic is subject to MASQUERADE"`
	want := []string{
		`-A IP-MASQ-AGENT -d 10.10.10.10/32 -p tcp ` + c + ` -m statistic --mode random --probability 0.46929256292 -j MASQUERADE --to-ports 1024-29999 --random-fully`,
		`-A IP-MASQ-AGENT -d 10.10.10.10/32 -p tcp ` + c + ` -j MASQUERADE --to-ports 32768-65535 --random-fully`,
		`-A IP-MASQ-AGENT -d 10.10.10.10/32 -p udp ` + c + ` -m statistic --mode random --probability 0.46929256292 -j MASQUERADE --to-ports 1024-29999 --random-fully`,
		`-A IP-MASQ-AGENT -d 10.10.10.10/32 -p udp ` + c + ` -j MASQUERADE --to-ports 32768-65535 --random-fully`,
		`-A IP-MASQ-AGENT -d 10.10.10.10/32 -p sctp ` + c + ` -m statistic --mode random --probability 0.46929256292 -j MASQUERADE --to-ports 1024-29999 --random-fully`,
		`-A IP-MASQ-AGENT -d 10.10.10.10/32 -p sctp ` + c + ` -j MASQUERADE --to-ports 32768-65535 --random-fully`,
		`-A IP-MASQ-AGENT -d 10.10.10.10/32 ` + c + ` -j MASQUERADE --random-fully`,
	}
	for i, w := range want {
		if got := lines[i].Rule.String(); got != w {
			t.Errorf("line %d:\n got  %s\n want %s", i, got, w)
		}
		if lines[i].Policy != &p.IPv4[0] || lines[i].Number != 1 {
			t.Errorf("line %d maps to rule %d (%+v), want rule 1", i, lines[i].Number, lines[i].Policy)
		}
	}
	// 28976 of 61744 ports are in the first range.
	if got, want := formatProbability(28976.0/61744), "0.46929256292"; got != want {
		t.Errorf("probability = %s, want %s", got, want)
	}
}

// Three ranges: 1/3 of the remaining, then 1/2 of the rest, then the last without statistic.
// A masquerade rule that names its source address is an SNAT rule to it, with the same port
// ranges (in --to-source, IPv6 bracketed) and random ports as MASQUERADE's; the others stay
// MASQUERADE.
func TestRenderSNAT(t *testing.T) {
	cfg, err := config.Parse([]byte(`masqueradeAddress: 192.0.2.11
masqueradeAddressIPv6: "2001:db8::11"
masqueradeCIDRs:
  - {cidr: 10.10.10.10/32, address: 192.0.2.12}
  - {cidr: "2001:db8:1::/48", address: "2001:db8::12"}
nonMasqueradeCIDRs: [10.0.0.0/8]
`), config.Options{EnableIPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	ports := policy.PortRanges{{First: 40000, Last: 40099}}
	p := policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: true, ToPorts: ports})
	const (
		specific = `-m comment --comment "ip-masq-agent: specific outbound traffic is subject to MASQUERADE"`
		outbound = `-m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)"`
	)
	want := map[policy.Family][]string{
		policy.IPv4: {
			"-A C -d 10.10.10.10/32 -p tcp " + specific + " -j SNAT --to-source 192.0.2.12:40000-40099 --random-fully",
			"-A C -d 10.10.10.10/32 -p udp " + specific + " -j SNAT --to-source 192.0.2.12:40000-40099 --random-fully",
			"-A C -d 10.10.10.10/32 -p sctp " + specific + " -j SNAT --to-source 192.0.2.12:40000-40099 --random-fully",
			"-A C -d 10.10.10.10/32 " + specific + " -j SNAT --to-source 192.0.2.12 --random-fully",
		},
		policy.IPv6: {
			"-A C -d 2001:db8:1::/48 -p tcp " + specific + " -j SNAT --to-source [2001:db8::12]:40000-40099 --random-fully",
			"-A C -d 2001:db8:1::/48 -p udp " + specific + " -j SNAT --to-source [2001:db8::12]:40000-40099 --random-fully",
			"-A C -d 2001:db8:1::/48 -p sctp " + specific + " -j SNAT --to-source [2001:db8::12]:40000-40099 --random-fully",
			"-A C -d 2001:db8:1::/48 " + specific + " -j SNAT --to-source 2001:db8::12 --random-fully",
		},
	}
	outbounds := map[policy.Family]string{
		policy.IPv4: "-A C -p tcp " + outbound + " -j SNAT --to-source 192.0.2.11:40000-40099 --random-fully",
		policy.IPv6: "-A C -p tcp " + outbound + " -j SNAT --to-source [2001:db8::11]:40000-40099 --random-fully",
	}
	for fam, lines := range want {
		var got []string
		for _, l := range ChainLines(p, fam, "C") {
			got = append(got, l.Rule.String())
		}
		if !slices.Equal(got[:4], lines) {
			t.Errorf("%s masqueradeCIDRs lines:\n%s\nwant\n%s", fam, strings.Join(got[:4], "\n"), strings.Join(lines, "\n"))
		}
		if !slices.Contains(got, outbounds[fam]) {
			t.Errorf("%s: no outbound line %q in\n%s", fam, outbounds[fam], strings.Join(got, "\n"))
		}
	}
	// Without a port range the address alone, and an address-less rule stays MASQUERADE.
	cfg.MasqueradeAddress = netip.Addr{}
	p = policy.Compile(cfg, policy.Options{})
	var got []string
	for _, l := range ChainLines(p, policy.IPv4, "C") {
		got = append(got, l.Rule.String())
	}
	if got[0] != "-A C -d 10.10.10.10/32 "+specific+" -j SNAT --to-source 192.0.2.12" || got[len(got)-1] != "-A C "+outbound+" -j MASQUERADE" {
		t.Errorf("lines without ports and without a masqueradeAddress:\n%s", strings.Join(got, "\n"))
	}
}

func TestToPortsProbabilitiesAreUniform(t *testing.T) {
	ports, _ := policy.ParsePortRanges("100-199,200-299,300-399")
	p := policy.Compile(config.Config{MasqOutBound: true, MasqLinkLocal: true}, policy.Options{ToPorts: ports})
	var probs []string
	for _, l := range ChainLines(p, policy.IPv4, DefaultChain)[:3] {
		if m := regexp.MustCompile(`--probability (\S+)`).FindStringSubmatch(l.Rule.String()); m != nil {
			probs = append(probs, m[1])
		} else {
			probs = append(probs, "-")
		}
	}
	if want := []string{"0.33333333349", "0.50000000000", "-"}; strings.Join(probs, " ") != strings.Join(want, " ") {
		t.Errorf("probabilities %v, want %v", probs, want)
	}
}

func TestValidateChain(t *testing.T) {
	for _, ok := range []string{"IP-MASQ-AGENT", "MASQ_2", "a", strings.Repeat("X", 28)} {
		if err := ValidateChain(ok); err != nil {
			t.Errorf("ValidateChain(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"", strings.Repeat("X", 29), "-A", "A B", "A\nCOMMIT", `A"`, "POSTROUTING", ".x"} {
		if err := ValidateChain(bad); err == nil {
			t.Errorf("ValidateChain(%q) accepted", bad)
		}
	}
}

// decideFromPayload is a tiny tracer over a rendered payload: it walks the chains from the main
// chain for a packet from src to dst the way the kernel does (first match of -s and -d; -j
// resumes the calling chain after a RETURN or the callee's end, -g does not) and returns what
// happens, with the source address an SNAT rule rewrites to (invalid for MASQUERADE, the
// uplink's address).
func decideFromPayload(t *testing.T, payload []byte, chain string, src, dst netip.Addr) (policy.Action, netip.Addr) {
	t.Helper()
	chains := map[string][][]string{}
	for _, line := range strings.Split(string(payload), "\n") {
		if rest, ok := strings.CutPrefix(line, "-A "); ok {
			args, err := splitArgs(rest)
			if err != nil {
				t.Fatalf("line %q: %v", line, err)
			}
			chains[args[0]] = append(chains[args[0]], args[1:])
		}
	}
	// walk returns whether the packet's fate was decided in chain (or a chain it went to), and
	// how.
	var walk func(chain string, depth int) (bool, policy.Action, netip.Addr)
	walk = func(chain string, depth int) (bool, policy.Action, netip.Addr) {
		if depth > 3 {
			t.Fatalf("chains nest deeper than the layout has them:\n%s", payload)
		}
		for _, args := range chains[chain] {
			match := true
			var target, source string
			var gotoChain bool
			for i := 0; i < len(args)-1; i++ {
				switch v := args[i+1]; args[i] {
				case "-s":
					match = match && netip.MustParsePrefix(v).Contains(src)
				case "-d":
					match = match && netip.MustParsePrefix(v).Contains(dst)
				case "-j", "-g":
					target, gotoChain = v, args[i] == "-g"
				case "--to-source":
					source, _, _ = strings.Cut(strings.TrimPrefix(v, "["), "]")
					if dst.Is4() {
						source, _, _ = strings.Cut(source, ":")
					}
				}
			}
			if !match {
				continue
			}
			switch target {
			case "RETURN":
				return false, policy.Return, netip.Addr{}
			case "MASQUERADE":
				return true, policy.Masquerade, netip.Addr{}
			case "SNAT":
				return true, policy.Masquerade, netip.MustParseAddr(source)
			}
			if _, ok := chains[target]; !ok && !strings.Contains(string(payload), ":"+target+" ") {
				t.Fatalf("target %s is neither a target nor a chain of the payload", target)
			}
			decided, action, addr := walk(target, depth+1)
			if decided || gotoChain {
				// A chain gone to returns to the chain that jumped to this one.
				return decided, action, addr
			}
		}
		return false, policy.Return, netip.Addr{} // the end of the chain
	}
	_, action, addr := walk(chain, 0)
	return action, addr
}

// Decide equals first match over the rendered rule list, for random configurations and
// random addresses (most of them inside configured prefixes, where the order matters).
func TestDecideEqualsFirstMatchOverRenderedChain(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for iter := range 300 {
		cfg := policytest.Config(r, r.IntN(20))
		if iter%2 == 1 {
			cfg = policytest.WithAddresses(r, cfg)
		}
		toPorts := policy.PortRanges(nil)
		if iter%3 == 0 {
			toPorts = policy.PortRanges{{First: 1024, Last: 2047}, {First: 40000, Last: 50000}}
		}
		p := policy.Compile(cfg, policy.Options{EnableIPv6: true, RandomFully: iter%2 == 0, ToPorts: toPorts})
		payload4 := Render(p, policy.IPv4, DefaultChain, true)
		payload6 := Render(p, policy.IPv6, DefaultChain, true)
		for range 200 {
			fam := policy.Families()[r.IntN(2)]
			addr := policytest.Destination(r, p, fam)
			payload := payload4
			if addr.Is6() {
				payload = payload6
			}
			want, source := decideFromPayload(t, payload, DefaultChain, policytest.Source(r, p, fam), addr)
			got := p.Decide(addr)
			if got.Action != want || (got.Rule != nil && got.Rule.Address != source) {
				t.Fatalf("config %s\naddress %s: Decide = %v (rule %+v), rendered chain says %v from %v\n%s",
					cfg.Canonical(), addr, got.Action, got.Rule, want, source, payload)
			}
		}
	}
}

// DecideFrom equals the kernel's walk over the rendered chains, for random policies with
// source rules (nested and overlapping sources, selected pods, whole address spaces) and
// random sources and destinations, most of them inside the rules' prefixes.
func TestDecideFromEqualsRenderedChains(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	withSources := 0
	for iter := range 300 {
		cfg := policytest.Config(r, r.IntN(8))
		if iter%2 == 1 {
			cfg = policytest.WithAddresses(r, cfg)
		}
		opts := policy.Options{EnableIPv6: iter%4 != 3, RandomFully: iter%2 == 0}
		if iter%3 == 0 {
			opts.ToPorts = policy.PortRanges{{First: 1024, Last: 2047}, {First: 40000, Last: 50000}}
		}
		cfg, opts = policytest.WithSourceRules(r, cfg, 6, opts)
		p := policy.Compile(cfg, opts)
		if len(p.Sources) > 0 {
			withSources++
		}
		payloads := map[policy.Family][]byte{}
		for _, fam := range policy.Families() {
			if p.Enabled(fam) {
				payloads[fam] = Render(p, fam, DefaultChain, true)
			}
		}
		for range 200 {
			fam := policy.Families()[r.IntN(2)]
			if !p.Enabled(fam) {
				continue
			}
			src, dst := policytest.Source(r, p, fam), policytest.Destination(r, p, fam)
			want, source := decideFromPayload(t, payloads[fam], DefaultChain, src, dst)
			got := p.DecideFrom(src, dst)
			if got.Action != want || (got.Rule != nil && got.Rule.Address != source) {
				t.Fatalf("config %s\n%s -> %s: DecideFrom = %v (source rule %v, rule %+v), rendered chains say %v from %v\n%s",
					cfg.Canonical(), src, dst, got.Action, got.SourceRule != nil, got.Rule, want, source, payloads[fam])
			}
		}
	}
	if withSources < 200 {
		t.Errorf("only %d of 300 policies had source rules", withSources)
	}
}

// A source rule's chain is named from --masq-chain and the rule within iptables' 28
// characters, a valid chain name of its own, distinct per rule and per main chain, and
// recognised as a source chain of its main chain only.
func TestSourceChainNames(t *testing.T) {
	long := strings.Repeat("C", 28)
	seen := map[string]bool{}
	for _, chain := range []string{DefaultChain, "MASQ", long, long[:27] + "D"} {
		for _, rule := range []string{"a", "batch", strings.Repeat("x", 40), strings.Repeat("x", 39) + "y"} {
			name := SourceChain(chain, rule)
			if err := ValidateChain(name); err != nil {
				t.Errorf("SourceChain(%q, %q) = %q: %v", chain, rule, name, err)
			}
			if seen[name] {
				t.Errorf("SourceChain(%q, %q) = %q, as for another rule or chain", chain, rule, name)
			}
			seen[name] = true
			if name != SourceChain(chain, rule) || !isSourceChain(chain, name) {
				t.Errorf("SourceChain(%q, %q) = %q: not stable or not recognised", chain, rule, name)
			}
			if isSourceChain("OTHER", name) {
				t.Errorf("%q taken for a source chain of OTHER", name)
			}
		}
	}
	if got := SourceChain(DefaultChain, "batch"); !strings.HasPrefix(got, DefaultChain+"-") {
		t.Errorf("SourceChain(%q, batch) = %q, want it to start with the chain's name", DefaultChain, got)
	}
	for _, name := range []string{DefaultChain, ProbeChain, DefaultChain + "-ABCDEFGHI", DefaultChain + "-abcdefghij", DefaultChain + "-ABCDEFGHI1"} {
		if isSourceChain(DefaultChain, name) {
			t.Errorf("%q taken for a source chain", name)
		}
	}
	if own := "ABCDEFGHIJKLMNOPQ-ABCDEFGHIJ"; isSourceChain(own, own) {
		t.Errorf("main chain %q taken for a source chain of its own", own)
	}
}

// One source rule renders as gotos from the top of the main chain, one per source prefix of
// the family, and a chain of its own ending in RETURN; Render of a policy without source rules
// is unchanged (TestRenderPayload).
func TestRenderSourceRule(t *testing.T) {
	cfg, err := config.Parse([]byte(`nonMasqueradeCIDRs: [10.0.0.0/8]
masqLinkLocal: true
sourceRules:
  - name: batch
    cidrs: [10.244.8.0/21, 10.244.20.7/32, "fd00:10:244:8::/64"]
    masqueradeAddress: 192.0.2.11
    nonMasqueradeCIDRs: []
`), config.Options{EnableIPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	p := policy.Compile(cfg, policy.Options{EnableIPv6: true})
	c := SourceChain(DefaultChain, "batch")
	want := `*nat
:IP-MASQ-AGENT - [0:0]
:` + c + ` - [0:0]
-A IP-MASQ-AGENT -s 10.244.8.0/21 -m comment --comment "ip-masq-agent: traffic from the sources of source rule batch is decided by its chain" -g ` + c + `
-A IP-MASQ-AGENT -s 10.244.20.7/32 -m comment --comment "ip-masq-agent: traffic from the sources of source rule batch is decided by its chain" -g ` + c + `
-A IP-MASQ-AGENT -d 10.0.0.0/8 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -j MASQUERADE
-A ` + c + ` -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -j SNAT --to-source 192.0.2.11
-A ` + c + ` -m comment --comment "ip-masq-agent: the rest of the traffic of source rule batch is not subject to MASQUERADE (must be last in chain)" -j RETURN
-A POSTROUTING -m comment --comment "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom IP-MASQ-AGENT chain" -m addrtype ! --dst-type LOCAL -j IP-MASQ-AGENT
COMMIT
`
	if got := string(Render(p, policy.IPv4, DefaultChain, true)); got != want {
		t.Errorf("IPv4 payload:\n%s\nwant:\n%s", got, want)
	}
	// The rule's chain is there in IPv6 too, with its own lines.
	got6 := string(Render(p, policy.IPv6, DefaultChain, false))
	for _, line := range []string{":" + c + " - [0:0]", "-A IP-MASQ-AGENT -s fd00:10:244:8::/64 ", "-A " + c + " -d fe80::/10 "} {
		if !strings.Contains(got6, line) {
			t.Errorf("IPv6 payload has no %q:\n%s", line, got6)
		}
	}
	// The lines between the chains implement no rule; the rule's own lines name it.
	for _, ch := range Layout(p, policy.IPv4, DefaultChain) {
		for _, l := range ch.Lines {
			if (l.Policy == nil) != (l.Rule.Goto || strings.Contains(l.Rule.Comment, "source rule")) {
				t.Errorf("line %s: policy rule %+v", l.Rule, l.Policy)
			}
			if l.Policy != nil && (ch.Source == nil) != (l.Policy.Set == "") {
				t.Errorf("line %s of chain %s is of list %q", l.Rule, ch.Name, l.Policy.Set)
			}
		}
	}
}

// The rendered chain, loaded into a real kernel in a throwaway namespace and listed by iptables,
// shows the seed's rows. Runs for both iptables modes.
func TestSeedChainsInTheKernel(t *testing.T) {
	testutil.RequirePrivileged(t, "ip", "iptables-nft-restore", "iptables-legacy-restore")
	for _, mode := range []string{"nft", "legacy"} {
		for _, name := range seedScenarios {
			t.Run(mode+"/"+name, func(t *testing.T) {
				ns := testutil.NewNetns(t)
				p := loadSeedPolicy(t, name+".yaml", policy.Options{EnableIPv6: true, RandomFully: true})
				restore := exec.Command("ip", "netns", "exec", ns, "iptables-"+mode+"-restore", "--noflush")
				restore.Stdin = strings.NewReader(string(Render(p, policy.IPv4, DefaultChain, true)))
				if out, err := restore.CombinedOutput(); err != nil {
					t.Fatalf("restore: %v: %s", err, out)
				}
				list, err := exec.Command("ip", "netns", "exec", ns, "iptables-"+mode, "-t", "nat", "-L", DefaultChain, "-v", "-n").CombinedOutput()
				if err != nil {
					t.Fatalf("list: %v: %s", err, list)
				}
				diffRules(t, parseListing(t, string(list)), readSeedChain(t, name+".chain"))
			})
		}
	}
}
