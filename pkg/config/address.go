package config

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
)

// MasqueradeCIDR is a masqueradeCIDRs entry: destinations that are always masqueraded, and the
// source address their traffic leaves from. A file writes it as the CIDR alone (the CCE form)
// or as a mapping {cidr: 10.10.10.10/32, address: 10.0.0.11}.
type MasqueradeCIDR struct {
	CIDR netip.Prefix
	// Address is the SNAT address; invalid means the family's masqueradeAddress, or the
	// uplink's primary address without one.
	Address netip.Addr
}

func (m MasqueradeCIDR) String() string {
	if !m.Address.IsValid() {
		return m.CIDR.String()
	}
	return m.CIDR.String() + " from " + m.Address.String()
}

// Family of an address: 4 or 6 (IPv4-mapped IPv6 addresses are refused before they get here).
func familyOf(a netip.Addr) int {
	if a.Is4() {
		return 4
	}
	return 6
}

// parseAddress parses a masquerade address as the file accepts it: an address of family fam (4
// or 6) that traffic can leave from (unicast, not loopback, link-local, multicast or
// unspecified), without a zone, not IPv4-mapped, IPv6 only when enabled; wrongFamily is the
// hint for one of the other family. Whether the node has it is the agent's to check (it may
// come and go).
func parseAddress(s string, fam int, enableIPv6 bool, wrongFamily string) (netip.Addr, error) {
	fail := func(problem, hint string) (netip.Addr, error) {
		return netip.Addr{}, &FieldError{Index: -1, Value: s, Problem: problem, Hint: hint}
	}
	a, err := netip.ParseAddr(s)
	switch {
	case err != nil:
		return fail("not an IP address", "write an address such as 10.0.0.11 or 2001:db8::11, without a prefix length")
	case a.Zone() != "":
		return fail("an address with a zone", "write the address without %"+a.Zone())
	case a.Is4In6():
		return fail("IPv4-mapped IPv6 addresses are not supported", "write the IPv4 address itself")
	case familyOf(a) != fam:
		return fail(fmt.Sprintf("an IPv%d address where an IPv%d one belongs", familyOf(a), fam), wrongFamily)
	case !a.IsGlobalUnicast():
		return fail("not an address traffic can leave from (loopback, link-local, multicast, broadcast or unspecified)", "")
	case fam == 6 && !enableIPv6:
		return fail("IPv6 address but IPv6 is not enabled", "start the agent with --enable-ipv6")
	}
	return a, nil
}

// address is a masquerade address of one family; the default is none.
func address(get func(*Config) *netip.Addr, fam int) value {
	parse := func(key string, raw json.RawMessage, opts Options) (netip.Addr, error) {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return netip.Addr{}, &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be an address string, not " + describeJSON(raw)}
		}
		if s == "" {
			return netip.Addr{}, nil // none: the uplink's primary address, as without the key
		}
		other := KeyMasqueradeAddressIPv6
		if fam == 6 {
			other = KeyMasqueradeAddress
		}
		a, err := parseAddress(s, fam, opts.EnableIPv6, "that one goes in "+other)
		if fe, ok := errors.AsType[*FieldError](err); ok {
			fe.Key = key
		}
		return a, err
	}
	return field[netip.Addr]{typ: "address", get: get, def: func(Options) netip.Addr { return netip.Addr{} }, parse: parse,
		toJSON: func(a netip.Addr) any { return showAddr(a) }, join: same(showAddr)}
}

// showAddr writes an address as the file does: empty for none.
func showAddr(a netip.Addr) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}

// masqueradeCIDRs is the list of masqueradeCIDRs entries, each a CIDR or a {cidr, address}
// mapping.
func masqueradeCIDRs(get func(*Config) *[]MasqueradeCIDR) value {
	return field[[]MasqueradeCIDR]{typ: "list of CIDRs or `{cidr, address}`", get: get,
		def: func(Options) []MasqueradeCIDR { return nil }, parse: decodeMasqueradeCIDRs,
		toJSON: func(ms []MasqueradeCIDR) any {
			out := make([]any, len(ms)) // never nil: an empty list is [], not null
			for i, m := range ms {
				if m.Address.IsValid() {
					out[i] = map[string]string{"cidr": m.CIDR.String(), "address": m.Address.String()}
				} else {
					out[i] = m.CIDR.String()
				}
			}
			return out
		}, join: joinMasqueradeCIDRs}
}

// joinMasqueradeCIDRs is concat, but for an entry whose CIDR an earlier file gives another
// address: the files disagree where its traffic leaves from.
func joinMasqueradeCIDRs(have, got []MasqueradeCIDR) ([]MasqueradeCIDR, *conflict) {
	for i, g := range got {
		if j := slices.IndexFunc(have, func(h MasqueradeCIDR) bool { return h.CIDR == g.CIDR && h.Address != g.Address }); j >= 0 &&
			!slices.Contains(have, g) {
			return have, &conflict{Index: j, Entry: i, Have: have[j].String(), Got: g.String()}
		}
	}
	return concat(have, got)
}

// Keys of a masqueradeCIDRs mapping.
const (
	entryCIDR    = "cidr"
	entryAddress = "address"
)

func decodeMasqueradeCIDRs(key string, raw json.RawMessage, opts Options) ([]MasqueradeCIDR, error) {
	// A list of strings, the CCE form, the normal case, decodes in one pass.
	var strs []string
	if json.Unmarshal(raw, &strs) == nil {
		prefixes, errs := parsePrefixes(key, strs, nil, opts)
		out := make([]MasqueradeCIDR, len(prefixes))
		for i, p := range prefixes {
			out[i] = MasqueradeCIDR{CIDR: p}
		}
		return out, errors.Join(errs...)
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be a list of CIDRs or {cidr, address} mappings, not " + describeJSON(raw),
			Hint: `for example ["10.10.10.10/32", {cidr: "10.20.0.0/16", address: "10.0.0.11"}]`}
	}
	var errs []error
	out := make([]MasqueradeCIDR, 0, len(items))
	for i, item := range items {
		m, err := decodeMasqueradeCIDR(item, opts)
		if err != nil {
			for _, e := range flatten(err) {
				if fe, ok := errors.AsType[*FieldError](e); ok {
					fe.Key, fe.Index = key, i
				}
				errs = append(errs, e)
			}
			continue
		}
		out = append(out, m)
	}
	return out, errors.Join(errs...)
}

// decodeMasqueradeCIDR reads one entry: a CIDR string, or a mapping of a CIDR and an address.
func decodeMasqueradeCIDR(item json.RawMessage, opts Options) (MasqueradeCIDR, error) {
	var s string
	if json.Unmarshal(item, &s) == nil {
		p, err := ParseCIDR(s, opts.EnableIPv6)
		return MasqueradeCIDR{CIDR: p}, err
	}
	var fields map[string]json.RawMessage
	if item[0] != '{' || json.Unmarshal(item, &fields) != nil {
		return MasqueradeCIDR{}, &FieldError{Index: -1, Value: display(item), Problem: "must be a CIDR string or a {cidr, address} mapping, not " + describeJSON(item)}
	}
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(fields)) {
		if name != entryCIDR && name != entryAddress {
			fe := &FieldError{Index: -1, Value: name, Problem: "unknown key of a masqueradeCIDRs mapping",
				Hint: fmt.Sprintf("it takes %s and %s", entryCIDR, entryAddress)}
			if d := closestOf(name, []string{entryCIDR, entryAddress}); d != "" {
				fe.Hint = fmt.Sprintf("did you mean %q?", d)
			}
			errs = append(errs, fe)
		}
	}
	str := func(name string) (string, bool) {
		raw, ok := fields[name]
		if !ok || string(raw) == "null" {
			return "", false
		}
		var v string
		if err := json.Unmarshal(raw, &v); err != nil {
			errs = append(errs, &FieldError{Index: -1, Value: display(raw), Problem: name + " must be a string, not " + describeJSON(raw)})
			return "", false
		}
		return v, true
	}
	var m MasqueradeCIDR
	if s, ok := str(entryCIDR); ok {
		p, err := ParseCIDR(s, opts.EnableIPv6)
		if err != nil {
			errs = append(errs, err)
		}
		m.CIDR = p
	} else if _, present := fields[entryCIDR]; !present {
		errs = append(errs, &FieldError{Index: -1, Value: display(item), Problem: "a mapping without " + entryCIDR,
			Hint: "write {cidr: 10.10.10.10/32, address: 10.0.0.11}"})
	}
	if s, ok := str(entryAddress); ok && m.CIDR.IsValid() {
		a, err := parseAddress(s, familyOf(m.CIDR.Addr()), opts.EnableIPv6, "an entry's address is of its CIDR's family")
		if fe, ok := errors.AsType[*FieldError](err); ok {
			fe.Problem = entryAddress + ": " + fe.Problem
			errs = append(errs, fe)
		}
		m.Address = a
	}
	return m, errors.Join(errs...)
}

// validateMasqueradeCIDRs: a CIDR listed twice must leave from one address; only the first entry
// would decide.
func (c Config) validateMasqueradeCIDRs() []error {
	var errs []error
	for i, m := range c.MasqueradeCIDRs {
		if j := slices.IndexFunc(c.MasqueradeCIDRs[:i], func(o MasqueradeCIDR) bool { return o.CIDR == m.CIDR && o.Address != m.Address }); j >= 0 {
			errs = append(errs, &FieldError{Key: KeyMasqueradeCIDRs, Index: i, Value: m.String(),
				Problem: fmt.Sprintf("repeats %s[%d] (%s) with another source address", KeyMasqueradeCIDRs, j, c.MasqueradeCIDRs[j]),
				Hint:    "the first entry decides: give the CIDR one address"})
		}
	}
	return errs
}
