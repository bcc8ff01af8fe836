package policy

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// masqCIDRs is masqueradeCIDRs entries without addresses.
func masqCIDRs(ss ...string) []config.MasqueradeCIDR {
	var out []config.MasqueradeCIDR
	for _, p := range mustPrefixes(ss...) {
		out = append(out, config.MasqueradeCIDR{CIDR: p})
	}
	return out
}

func mustPrefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// The rule order of DESIGN section 2: masqueradeCIDRs, link-local, nonMasqueradeCIDRs, outbound.
func TestCompileOrder(t *testing.T) {
	cfg := config.Config{
		MasqueradeCIDRs:    masqCIDRs("10.10.10.10/32", "2001:db8::1/128"),
		NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/8", "fc00::/7", "172.16.0.0/12"),
		MasqOutBound:       true,
		MasqOutBoundIPv6:   false,
	}
	p := Compile(cfg, Options{EnableIPv6: true})
	type row struct {
		prefix string
		action Action
		source string
	}
	check := func(fam Family, want []row) {
		t.Helper()
		rules := p.Rules(fam)
		if len(rules) != len(want) {
			t.Fatalf("%v: %d rules, want %d: %+v", fam, len(rules), len(want), rules)
		}
		for i, w := range want {
			r := rules[i]
			if r.Prefix.String() != w.prefix || r.Action != w.action || r.Source() != w.source || r.Family != fam {
				t.Errorf("%v rule %d = %s %v %q, want %s %v %q", fam, i+1, r.Prefix, r.Action, r.Source(), w.prefix, w.action, w.source)
			}
		}
	}
	check(IPv4, []row{
		{"10.10.10.10/32", Masquerade, "masqueradeCIDRs[0]"},
		{"169.254.0.0/16", Return, "link-local (masqLinkLocal: false)"},
		{"10.0.0.0/8", Return, "nonMasqueradeCIDRs[0]"},
		{"172.16.0.0/12", Return, "nonMasqueradeCIDRs[2]"},
		{"0.0.0.0/0", Masquerade, "masqOutBound: true"},
	})
	check(IPv6, []row{
		{"2001:db8::1/128", Masquerade, "masqueradeCIDRs[1]"},
		{"fe80::/10", Return, "link-local (masqLinkLocalIPv6: false)"},
		{"fc00::/7", Return, "nonMasqueradeCIDRs[1]"},
	})
	if a, r := p.OutboundAction(IPv4); a != Masquerade || r != &p.IPv4[4] {
		t.Errorf("OutboundAction(IPv4) = %v, %+v", a, r)
	}
	if a, r := p.OutboundAction(IPv6); a != Return || r != nil {
		t.Errorf("OutboundAction(IPv6) = %v, %+v", a, r)
	}
}

func TestCompileComments(t *testing.T) {
	p := Compile(config.Config{MasqueradeCIDRs: masqCIDRs("1.2.3.4/32"), NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/8"), MasqOutBound: true}, Options{})
	want := []string{CommentSpecificMasquerade, CommentNonMasquerade, CommentNonMasquerade, CommentOutbound}
	if len(p.IPv4) != len(want) {
		t.Fatalf("%d rules, want %d: %+v", len(p.IPv4), len(want), p.IPv4)
	}
	for i, r := range p.IPv4 {
		if r.Comment != want[i] {
			t.Errorf("rule %d comment %q, want %q", i+1, r.Comment, want[i])
		}
	}
}

func TestMasqLinkLocalDropsTheRule(t *testing.T) {
	p := Compile(config.Config{MasqLinkLocal: true, MasqLinkLocalIPv6: true}, Options{EnableIPv6: true})
	if len(p.IPv4) != 0 || len(p.IPv6) != 0 {
		t.Errorf("rules = %+v %+v, want none", p.IPv4, p.IPv6)
	}
	if v := p.Decide(netip.MustParseAddr("169.254.169.254")); v.Action != Return || v.Rule != nil {
		t.Errorf("Decide(169.254.169.254) = %+v", v)
	}
}

// An enabled family without rules is still managed: told apart from a disabled one.
func TestEnabledFamilyWithoutRules(t *testing.T) {
	cfg := config.Config{MasqLinkLocal: true, MasqLinkLocalIPv6: true}
	on, off := Compile(cfg, Options{EnableIPv6: true}), Compile(cfg, Options{})
	if !on.Enabled(IPv6) || off.Enabled(IPv6) || !off.Enabled(IPv4) {
		t.Errorf("Enabled(IPv6) = %v with --enable-ipv6, %v without", on.Enabled(IPv6), off.Enabled(IPv6))
	}
	if on.Equal(off) || off.Equal(on) {
		t.Error("a policy with IPv6 enabled equals one without")
	}
	if v := on.Decide(netip.MustParseAddr("2001:db8::1")); strings.Contains(v.Reason, "--enable-ipv6") {
		t.Errorf("Decide(IPv6) with IPv6 enabled = %+v", v)
	}
}

func TestDecide(t *testing.T) {
	cfg := config.Default(config.Options{})
	cfg.MasqueradeCIDRs = masqCIDRs("10.10.10.10/32", "169.254.169.254/32")
	cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs, mustPrefixes("fd00::/8")...)
	p := Compile(cfg, Options{EnableIPv6: true})
	tests := []struct {
		addr   string
		action Action
		number int // 0: no rule
	}{
		{"10.10.10.10", Masquerade, 1},     // masqueradeCIDRs beat the wider non-masquerade 10/8
		{"10.10.10.11", Return, 4},         // 10.0.0.0/8
		{"169.254.169.254", Masquerade, 2}, // masqueradeCIDRs beat link-local
		{"169.254.1.1", Return, 3},         // link-local
		{"172.31.255.255", Return, 5},      // 172.16.0.0/12, last address
		{"172.32.0.0", Masquerade, 7},      // just outside
		{"8.8.8.8", Masquerade, 7},         // outbound
		{"::ffff:10.1.1.1", Return, 4},     // IPv4-mapped counts as IPv4
		{"fd12::1", Return, 2},             // fd00::/8 (IPv6 list: link-local #1, fd00::/8 #2, outbound #3)
		{"fe80::1", Return, 1},             // IPv6 link-local
		{"2001:4860:4860::8888", Masquerade, 3},
	}
	for _, tt := range tests {
		v := p.Decide(netip.MustParseAddr(tt.addr))
		num := 0
		if v.Rule != nil {
			num = v.Number
			if rules := p.Rules(FamilyOf(netip.MustParseAddr(tt.addr))); v.Rule != &rules[num-1] {
				t.Errorf("Decide(%s): rule %+v is not rule %d", tt.addr, v.Rule, num)
			}
		}
		if v.Action != tt.action || num != tt.number {
			t.Errorf("Decide(%s) = %v rule %d, want %v rule %d", tt.addr, v.Action, num, tt.action, tt.number)
		}
	}
}

func TestDecideWithoutIPv6OrOutbound(t *testing.T) {
	cfg := config.Default(config.Options{})
	cfg.MasqOutBound = false
	p := Compile(cfg, Options{EnableIPv6: false})
	if p.IPv6 != nil {
		t.Errorf("IPv6 rules without --enable-ipv6: %+v", p.IPv6)
	}
	v := p.Decide(netip.MustParseAddr("2001:db8::1"))
	if v.Action != Return || v.Rule != nil || !strings.Contains(v.Reason, "--enable-ipv6") {
		t.Errorf("Decide(IPv6) = %+v", v)
	}
	v = p.Decide(netip.MustParseAddr("8.8.8.8"))
	if v.Action != Return || v.Rule != nil || !strings.Contains(v.Reason, "masqOutBound is false") {
		t.Errorf("Decide(8.8.8.8) = %+v", v)
	}
}

// Duplicates: the first entry decides; the later one never matches (as in the chain).
func TestDuplicateEntriesFirstWins(t *testing.T) {
	cfg := config.Config{NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/8", "10.0.0.0/8"), MasqueradeCIDRs: masqCIDRs("10.0.0.0/8")}
	p := Compile(cfg, Options{})
	if v := p.Decide(netip.MustParseAddr("10.1.1.1")); v.Action != Masquerade || v.Rule != &p.IPv4[0] || v.Number != 1 {
		t.Errorf("Decide = %+v", v)
	}
}

func TestParsePortRanges(t *testing.T) {
	good := map[string]string{
		"":                       "",
		"32768-65535":            "32768-65535",
		"1024-29999,32768-65535": "1024-29999,32768-65535",
		"5000":                   "5000",
		"1-1,65535":              "1,65535",
	}
	for in, want := range good {
		rs, err := ParsePortRanges(in)
		if err != nil || rs.String() != want {
			t.Errorf("ParsePortRanges(%q) = %q, %v; want %q", in, rs, err, want)
		}
	}
	if rs, _ := ParsePortRanges("1024-29999,32768-65535"); rs.Size() != 28976+32768 {
		t.Errorf("size = %d", rs.Size())
	}
	for _, bad := range []string{"0-10", "10-5", "1-65536", "a-b", "1024-", "-5", "1,,2", "100-200,150-160", " 5", "1-2-3"} {
		if _, err := ParsePortRanges(bad); err == nil {
			t.Errorf("ParsePortRanges(%q) accepted", bad)
		}
	}
}

func TestEqual(t *testing.T) {
	a := Compile(config.Config{NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/8"), MasqOutBound: true}, Options{RandomFully: true})
	same := Compile(config.Config{NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/8"), MasqOutBound: true}, Options{RandomFully: true})
	if !a.Equal(same) || !a.Equal(a) || !(*Policy)(nil).Equal(nil) {
		t.Error("equal policies compare unequal")
	}
	for name, q := range map[string]*Policy{
		"nil":          nil,
		"other CIDR":   Compile(config.Config{NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/9"), MasqOutBound: true}, Options{RandomFully: true}),
		"no outbound":  Compile(config.Config{NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/8")}, Options{RandomFully: true}),
		"random-fully": Compile(config.Config{NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/8"), MasqOutBound: true}, Options{}),
		"IPv6":         Compile(config.Config{NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/8"), MasqOutBound: true}, Options{RandomFully: true, EnableIPv6: true}),
		"to-ports":     Compile(config.Config{NonMasqueradeCIDRs: mustPrefixes("10.0.0.0/8"), MasqOutBound: true}, Options{RandomFully: true, ToPorts: PortRanges{{First: 1024, Last: 2047}}}),
	} {
		if a.Equal(q) || (q != nil && q.Equal(a)) {
			t.Errorf("%s: unequal policies compare equal", name)
		}
	}
}

// MayMasquerade is false exactly where the chain keeps a whole prefix, and agrees with Decide on
// single addresses.
func TestMayMasquerade(t *testing.T) {
	cfg := config.Config{
		MasqueradeCIDRs:    masqCIDRs("10.10.10.10/32"),
		NonMasqueradeCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("192.168.0.0/16")},
		MasqOutBound:       true,
	}
	p := Compile(cfg, Options{})
	for prefix, want := range map[string]bool{
		"0.0.0.0/0":        true,  // the default route: the outbound rule masquerades
		"10.244.1.2/32":    false, // a pod
		"10.244.0.0/16":    false,
		"10.10.0.0/16":     true, // holds the masqueraded 10.10.10.10
		"10.10.10.10/32":   true,
		"192.168.100.0/24": false,
		"203.0.113.0/24":   true,
		"8.0.0.0/6":        true,
		"::/0":             false, // IPv6 not enabled
	} {
		if got := p.MayMasquerade(netip.MustParsePrefix(prefix)); got != want {
			t.Errorf("%s: MayMasquerade %v, want %v", prefix, got, want)
		}
	}
	cfg.MasqOutBound = false
	p = Compile(cfg, Options{})
	for prefix, want := range map[string]bool{"0.0.0.0/0": true, "203.0.113.0/24": false, "10.10.10.0/24": true} {
		if got := p.MayMasquerade(netip.MustParsePrefix(prefix)); got != want {
			t.Errorf("without masqOutBound, %s: MayMasquerade %v, want %v", prefix, got, want)
		}
	}
	for _, a := range []string{"10.10.10.10", "10.1.2.3", "8.8.8.8", "192.168.1.1"} {
		addr := netip.MustParseAddr(a)
		if got, want := p.MayMasquerade(netip.PrefixFrom(addr, 32)), p.Decide(addr).Action == Masquerade; got != want {
			t.Errorf("%s/32: MayMasquerade %v, Decide says masquerade %v", a, got, want)
		}
	}
}

// Addresses: each masquerade address once, with the destinations whose device it must be on:
// the family's default for masqueradeAddress (the entries without an address of their own add
// nothing), each entry's CIDR for its own.
func TestAddressesTo(t *testing.T) {
	a := netip.MustParseAddr
	cfg := config.Config{
		MasqueradeAddress: a("192.0.2.10"),
		MasqueradeCIDRs: []config.MasqueradeCIDR{
			{CIDR: netip.MustParsePrefix("8.8.8.0/24")},
			{CIDR: netip.MustParsePrefix("198.18.0.0/16"), Address: a("203.0.113.10")},
			{CIDR: netip.MustParsePrefix("198.19.0.0/16"), Address: a("203.0.113.10")},
			{CIDR: netip.MustParsePrefix("9.9.9.0/24"), Address: a("192.0.2.10")},
		},
		MasqOutBound: true,
	}
	var got []string
	for _, u := range Compile(cfg, Options{}).Addresses() {
		got = append(got, fmt.Sprintf("%s %v", u, u.To))
	}
	want := "masqueradeAddress 192.0.2.10 [0.0.0.0/0]; masqueradeCIDRs[1] 203.0.113.10 [198.18.0.0/16 198.19.0.0/16]"
	if s := strings.Join(got, "; "); s != want {
		t.Errorf("Addresses %s\nwant %s", s, want)
	}
}
