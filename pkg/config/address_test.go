package config

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// TestParseMasqueradeAddresses: the addresses of both families, and masqueradeCIDRs entries as
// strings (the CCE form) and mappings, in one list; the canonical form reads back the same.
func TestParseMasqueradeAddresses(t *testing.T) {
	doc := `
masqueradeAddress: 10.0.0.11
masqueradeAddressIPv6: "2001:db8::11"
masqueradeCIDRs:
  - 10.10.10.10/32
  - cidr: 10.20.0.0/16
    address: 10.0.0.12
  - {cidr: "2001:db8:20::/48", address: "2001:db8::12"}
  - {cidr: 10.30.0.0/16}
`
	opts := Options{EnableIPv6: true}
	cfg, err := Parse([]byte(doc), opts)
	if err != nil {
		t.Fatal(err)
	}
	want := []MasqueradeCIDR{
		{CIDR: netip.MustParsePrefix("10.10.10.10/32")},
		{CIDR: netip.MustParsePrefix("10.20.0.0/16"), Address: netip.MustParseAddr("10.0.0.12")},
		{CIDR: netip.MustParsePrefix("2001:db8:20::/48"), Address: netip.MustParseAddr("2001:db8::12")},
		{CIDR: netip.MustParsePrefix("10.30.0.0/16")},
	}
	if !slices.Equal(cfg.MasqueradeCIDRs, want) || cfg.MasqueradeAddress != netip.MustParseAddr("10.0.0.11") ||
		cfg.MasqueradeAddressIPv6 != netip.MustParseAddr("2001:db8::11") {
		t.Errorf("parsed %+v", cfg)
	}
	canonical := string(cfg.Canonical())
	for _, w := range []string{`"masqueradeCIDRs":["10.10.10.10/32",{"address":"10.0.0.12","cidr":"10.20.0.0/16"},`,
		`"masqueradeAddress":"10.0.0.11","masqueradeAddressIPv6":"2001:db8::11"}`} {
		if !strings.Contains(canonical, w) {
			t.Errorf("canonical form %s lacks %s", canonical, w)
		}
	}
	again, err := Parse(cfg.Canonical(), opts)
	if err != nil || !equal(again, cfg) {
		t.Errorf("the canonical form reads back as %+v, %v", again, err)
	}
	// An empty address is none, as an absent key.
	if cfg, err := Parse([]byte(`masqueradeAddress: ""`), Options{}); err != nil || cfg.MasqueradeAddress.IsValid() {
		t.Errorf("an empty masqueradeAddress: %v, %v", cfg.MasqueradeAddress, err)
	}
}

// Every new validation failure names the key (and entry), the value and what is wrong.
func TestMasqueradeAddressErrors(t *testing.T) {
	v6 := Options{EnableIPv6: true}
	for _, tt := range []struct {
		name  string
		doc   string
		opts  Options
		wants []string
	}{
		{"not an address", "masqueradeAddress: bogus", Options{}, []string{"masqueradeAddress", `"bogus"`, "not an IP address"}},
		{"a prefix", "masqueradeAddress: 10.0.0.11/32", Options{}, []string{`"10.0.0.11/32"`, "not an IP address", "without a prefix length"}},
		{"a number", "masqueradeAddress: 12", Options{}, []string{"masqueradeAddress", `"12"`, "address string, not a number"}},
		{"IPv6 in the IPv4 key", `masqueradeAddress: "2001:db8::11"`, v6,
			[]string{"masqueradeAddress", "an IPv6 address where an IPv4 one belongs", "that one goes in masqueradeAddressIPv6"}},
		{"IPv4 in the IPv6 key", "masqueradeAddressIPv6: 10.0.0.11", v6,
			[]string{"masqueradeAddressIPv6", "an IPv4 address where an IPv6 one belongs", "that one goes in masqueradeAddress"}},
		{"IPv6 without --enable-ipv6", `masqueradeAddressIPv6: "2001:db8::11"`, Options{},
			[]string{"masqueradeAddressIPv6", "IPv6 is not enabled", "--enable-ipv6"}},
		{"IPv4-mapped", `masqueradeAddressIPv6: "::ffff:10.0.0.11"`, v6, []string{"IPv4-mapped", "the IPv4 address itself"}},
		{"zone", `masqueradeAddressIPv6: "2001:db8::11%eth0"`, v6, []string{"a zone", "without %eth0"}},
		{"loopback", "masqueradeAddress: 127.0.0.1", Options{}, []string{`"127.0.0.1"`, "not an address traffic can leave from"}},
		{"unspecified", "masqueradeAddress: 0.0.0.0", Options{}, []string{`"0.0.0.0"`, "not an address traffic can leave from"}},
		{"multicast", "masqueradeAddress: 224.0.0.1", Options{}, []string{`"224.0.0.1"`, "not an address traffic can leave from"}},
		{"broadcast", "masqueradeAddress: 255.255.255.255", Options{}, []string{"not an address traffic can leave from"}},
		{"link-local", `masqueradeAddressIPv6: "fe80::1"`, v6, []string{`"fe80::1"`, "not an address traffic can leave from"}},

		{"an entry's bad address", "masqueradeCIDRs: [{cidr: 10.0.0.0/8, address: bogus}]", Options{},
			[]string{"masqueradeCIDRs[0]", `"bogus"`, "address: not an IP address"}},
		{"an entry's address of the other family", `masqueradeCIDRs: [{cidr: 10.0.0.0/8, address: "2001:db8::11"}]`, v6,
			[]string{"masqueradeCIDRs[0]", "address: an IPv6 address where an IPv4 one belongs", "of its CIDR's family"}},
		{"an entry's address that cannot be a source", "masqueradeCIDRs: [10.1.0.0/16, {cidr: 10.0.0.0/8, address: 127.0.0.1}]", Options{},
			[]string{"masqueradeCIDRs[1]", "address: not an address traffic can leave from"}},
		{"a mapping without cidr", "masqueradeCIDRs: [{address: 10.0.0.11}]", Options{},
			[]string{"masqueradeCIDRs[0]", "a mapping without cidr", "write {cidr: 10.10.10.10/32, address: 10.0.0.11}"}},
		{"a mapping's unknown key", "masqueradeCIDRs: [{cidr: 10.0.0.0/8, adress: 10.0.0.11}]", Options{},
			[]string{"masqueradeCIDRs[0]", `"adress"`, "unknown key of a masqueradeCIDRs mapping", `did you mean "address"`}},
		{"a mapping's bad CIDR", "masqueradeCIDRs: [{cidr: 10.0.0.1/8, address: 10.0.0.11}]", Options{},
			[]string{"masqueradeCIDRs[0]", `"10.0.0.1/8"`, "host bits", `did you mean "10.0.0.0/8"`}},
		{"a mapping's CIDR not a string", "masqueradeCIDRs: [{cidr: 5}]", Options{},
			[]string{"masqueradeCIDRs[0]", "cidr must be a string, not a number"}},
		{"an entry neither string nor mapping", "masqueradeCIDRs: [[10.0.0.0/8]]", Options{},
			[]string{"masqueradeCIDRs[0]", "must be a CIDR string or a {cidr, address} mapping, not a list"}},
		{"the list not a list", "masqueradeCIDRs: {cidr: 10.0.0.0/8}", Options{},
			[]string{"masqueradeCIDRs", "must be a list of CIDRs or {cidr, address} mappings, not a mapping"}},
		{"a CIDR twice with two addresses", "masqueradeCIDRs: [{cidr: 10.0.0.0/8, address: 10.0.0.11}, 10.1.0.0/16, 10.0.0.0/8]", Options{},
			[]string{"masqueradeCIDRs[2]", "repeats masqueradeCIDRs[0] (10.0.0.0/8 from 10.0.0.11) with another source address", "the first entry decides"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.doc), tt.opts)
			if err == nil {
				t.Fatalf("Parse(%q) succeeded, want an error", tt.doc)
			}
			for _, w := range tt.wants {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
	// Every wrong entry is reported, in list order.
	_, err := Parse([]byte("masqueradeCIDRs: [{cidr: x}, 10.0.0.1/8, {cidr: 10.0.0.0/8, address: y}]"), Options{})
	if got := strings.Count(err.Error(), "masqueradeCIDRs["); got != 3 || strings.Index(err.Error(), "[0]") > strings.Index(err.Error(), "[2]") {
		t.Errorf("three wrong entries: %v", err)
	}
	// The same CIDR twice with one address is a repeat, as in the CCE form.
	if _, err := Parse([]byte("masqueradeCIDRs: [{cidr: 10.0.0.0/8, address: 10.0.0.11}, {cidr: 10.0.0.0/8, address: 10.0.0.11}]"), Options{}); err != nil {
		t.Errorf("a CIDR repeated with its address: %v", err)
	}
}

// Merging files: an entry whose CIDR an earlier file gives another address, and addresses that
// disagree, are conflicts naming both files; an entry repeated as it was is dropped.
func TestMergeMasqueradeAddresses(t *testing.T) {
	cfg, err := Load(dirOf(t, map[string]string{
		"ip-masq-a": "masqueradeCIDRs: [{cidr: 10.20.0.0/16, address: 10.0.0.12}]\nmasqueradeAddress: 10.0.0.11\n",
		"ip-masq-b": "masqueradeCIDRs: [10.10.10.10/32, {cidr: 10.20.0.0/16, address: 10.0.0.12}]\nmasqueradeAddress: 10.0.0.11\n",
	}), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got := fmtList(cfg.MasqueradeCIDRs); got != "10.20.0.0/16 from 10.0.0.12, 10.10.10.10/32" || cfg.MasqueradeAddress.String() != "10.0.0.11" {
		t.Errorf("merged %s, %s", got, cfg.MasqueradeAddress)
	}
	for _, c := range []struct {
		files map[string]string
		wants []string
	}{
		{map[string]string{"ip-masq-a": "masqueradeCIDRs: [{cidr: 10.20.0.0/16, address: 10.0.0.12}]\n",
			"ip-masq-b": "masqueradeCIDRs: [10.1.0.0/16, 10.20.0.0/16]\n"},
			[]string{`masqueradeCIDRs[1]: "10.20.0.0/16" in ip-masq-b conflicts with "10.20.0.0/16 from 10.0.0.12" in ip-masq-a`}},
		{map[string]string{"ip-masq-a": "masqueradeAddress: 10.0.0.11\n", "ip-masq-b": "masqueradeAddress: 10.0.0.12\n"},
			[]string{`masqueradeAddress: "10.0.0.12" in ip-masq-b conflicts with "10.0.0.11" in ip-masq-a`}},
	} {
		if _, err := Load(dirOf(t, c.files), Options{}); err == nil {
			t.Errorf("merged %v without an error", c.files)
		} else {
			for _, w := range c.wants {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		}
	}
}

func fmtList[T interface{ String() string }](l []T) string {
	out := make([]string, len(l))
	for i, e := range l {
		out[i] = e.String()
	}
	return strings.Join(out, ", ")
}
