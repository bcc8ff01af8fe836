package config

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzParse feeds arbitrary documents to the parser. Whatever comes in, Parse must not panic,
// and what it accepts must be valid and survive a round trip through Canonical. The corpus in
// testdata/fuzz/FuzzParse holds injection attempts (iptables arguments, newlines, comments),
// huge lists, deep nesting and non-UTF-8 input; `go test` replays it on every run.
func FuzzParse(f *testing.F) {
	f.Add([]byte("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 60s"), false)
	f.Add([]byte(`{"masqueradeCIDRs":["fd00::/8"],"masqOutBoundIPv6":false}`), true)
	f.Add([]byte("masqueradeCIDRs: [{cidr: 10.9.0.0/16, address: 10.0.0.11}, 10.10.10.10/32]\nmasqueradeAddress: 10.0.0.12"), false)
	f.Add([]byte(`{"masqueradeAddressIPv6":"2001:db8::11","masqueradeCIDRs":[{"cidr":"fd00::/8","address":"fd00::1"}]}`), true)
	f.Fuzz(func(t *testing.T, doc []byte, enableIPv6 bool) {
		opts := Options{EnableIPv6: enableIPv6}
		cfg, err := Parse(doc, opts)
		if err != nil {
			checkErrorBounded(t, err)
			return
		}
		masq := make([]netip.Prefix, len(cfg.MasqueradeCIDRs))
		for i, m := range cfg.MasqueradeCIDRs {
			masq[i] = m.CIDR
			if a := m.Address; a.IsValid() && (!a.IsGlobalUnicast() || a.Zone() != "" || a.Is4In6() || a.Is4() != m.CIDR.Addr().Is4()) {
				t.Fatalf("accepted the address %v for %v", a, m.CIDR)
			}
		}
		for _, a := range []netip.Addr{cfg.MasqueradeAddress, cfg.MasqueradeAddressIPv6} {
			if a.IsValid() && (!a.IsGlobalUnicast() || a.Zone() != "" || a.Is4In6() || (a.Is6() && !enableIPv6)) {
				t.Fatalf("accepted the masquerade address %v", a)
			}
		}
		if a := cfg.MasqueradeAddress; a.IsValid() && !a.Is4() || cfg.MasqueradeAddressIPv6.Is4() {
			t.Fatalf("accepted masquerade addresses of the wrong family: %v, %v", cfg.MasqueradeAddress, cfg.MasqueradeAddressIPv6)
		}
		for _, list := range [][]string{prefixStrings(cfg.NonMasqueradeCIDRs), prefixStrings(masq)} {
			for _, s := range list {
				// Only canonical prefixes leave the package: nothing else can reach a command line.
				if strings.Trim(s, "0123456789abcdef.:/") != "" {
					t.Fatalf("accepted prefix %q has characters a prefix never has", s)
				}
			}
		}
		for _, p := range append(slices.Clone(cfg.NonMasqueradeCIDRs), masq...) {
			if p != p.Masked() || !p.IsValid() || p.Addr().Zone() != "" || p.Addr().Is4In6() {
				t.Fatalf("accepted a non-canonical prefix %v", p)
			}
			if p.Addr().Is6() && !enableIPv6 {
				t.Fatalf("accepted IPv6 prefix %v without IPv6 enabled", p)
			}
		}
		if len(cfg.NonMasqueradeCIDRs) > cfg.CIDRLimit {
			t.Fatalf("accepted %d nonMasqueradeCIDRs over cidrLimit %d", len(cfg.NonMasqueradeCIDRs), cfg.CIDRLimit)
		}
		if cfg.ResyncInterval < MinResyncInterval {
			t.Fatalf("accepted resyncInterval %v", cfg.ResyncInterval)
		}
		again, err := Parse(cfg.Canonical(), opts)
		if err != nil {
			t.Fatalf("canonical form %s does not parse: %v", cfg.Canonical(), err)
		}
		if !equal(cfg, again) {
			t.Fatalf("round trip changed the config:\n%+v\n%+v", cfg, again)
		}
	})
}

// checkErrorBounded: an error names what was wrong without echoing unbounded input.
func checkErrorBounded(t *testing.T, err error) {
	var fes []error = []error{err}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		fes = j.Unwrap()
	}
	for _, e := range fes {
		var fe *FieldError
		if errors.As(e, &fe) && len(fe.Error()) > 600 {
			t.Fatalf("field error of %d bytes: %.100s", len(fe.Error()), fe.Error())
		}
		if errors.As(e, &fe) && !utf8.ValidString(fe.Error()) {
			t.Fatalf("field error is not valid UTF-8: %q", fe.Error())
		}
	}
}
