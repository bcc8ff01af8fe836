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

// Every wrong entry of masqueradeCIDRs is reported; a repeat with its own address is none
// (configtest.Invalid has each kind of wrong address).
func TestMasqueradeAddressErrors(t *testing.T) {
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
