package config

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"time"
)

// Keys of the configuration file, as users write them. Each names one row of Keys.
const (
	KeyNonMasqueradeCIDRs = "nonMasqueradeCIDRs"
	KeyMasqueradeCIDRs    = "masqueradeCIDRs"
	KeyMasqOutBound       = "masqOutBound"
	KeyMasqOutBoundIPv6   = "masqOutBoundIPv6"
	KeyMasqLinkLocal      = "masqLinkLocal"
	KeyMasqLinkLocalIPv6  = "masqLinkLocalIPv6"
	KeyCIDRLimit          = "cidrLimit"
	KeyResyncInterval     = "resyncInterval"
	// The SNAT address of a family, instead of the uplink's primary one.
	KeyMasqueradeAddress     = "masqueradeAddress"
	KeyMasqueradeAddressIPv6 = "masqueradeAddressIPv6"
)

// Keys is the one definition of the configuration file: a row per key, in the order of the
// canonical form and of the README's configuration table (a test keeps the two in step). Parse,
// Default and Canonical are derived from it: a new key is a row here, its name above and its
// field in Config.
var Keys = []Key{
	{KeyNonMasqueradeCIDRs, "destinations that keep the pod's address",
		cidrs(func(c *Config) *[]netip.Prefix { return &c.NonMasqueradeCIDRs }, defaultNonMasquerade)},
	{KeyMasqueradeCIDRs, "destinations that are always masqueraded, even inside a non-masquerade range; `{cidr: 10.10.10.10/32, address: 10.0.0.11}` also says the source address they leave from",
		masqueradeCIDRs(func(c *Config) *[]MasqueradeCIDR { return &c.MasqueradeCIDRs })},
	{KeyMasqOutBound, "IPv4: masquerade everything no rule above matched",
		boolean(func(c *Config) *bool { return &c.MasqOutBound }, true)},
	{KeyMasqOutBoundIPv6, "the same for IPv6",
		boolean(func(c *Config) *bool { return &c.MasqOutBoundIPv6 }, true)},
	{KeyMasqLinkLocal, "masquerade traffic to `169.254.0.0/16`",
		boolean(func(c *Config) *bool { return &c.MasqLinkLocal }, false)},
	{KeyMasqLinkLocalIPv6, "masquerade traffic to `fe80::/10`",
		boolean(func(c *Config) *bool { return &c.MasqLinkLocalIPv6 }, false)},
	{KeyCIDRLimit, "the most `nonMasqueradeCIDRs` entries accepted (a guard against mistakes)",
		count(func(c *Config) *int { return &c.CIDRLimit }, 64)},
	{KeyResyncInterval, "how often the file is re-read and the datapath re-checked (at least `100ms`)",
		interval(func(c *Config) *time.Duration { return &c.ResyncInterval }, 60*time.Second, MinResyncInterval)},
	{KeyMasqueradeAddress, "the source address of masqueraded IPv4 traffic instead of the uplink's primary one: an address of the uplink",
		address(func(c *Config) *netip.Addr { return &c.MasqueradeAddress }, 4)},
	{KeyMasqueradeAddressIPv6, "the same for IPv6",
		address(func(c *Config) *netip.Addr { return &c.MasqueradeAddressIPv6 }, 6)},
	{KeySourceRules, "pods whose traffic is decided by keys of their own: each rule names its sources (`cidrs`, `namespaceSelector`, `podSelector`) and the keys it sets for them (see [configuration](docs/configuration.md#source-rules))",
		sourceRules(func(c *Config) *[]SourceRule { return &c.SourceRules })},
}

// Key is one key of the configuration file.
type Key struct {
	Name string
	// Doc says what the key means, as the README's configuration table does.
	Doc string
	value
}

// Type names the kind of the key's value, as the README's table does ("bool").
func (k Key) Type() string { return k.typeName() }

// value is a key's value: where it lives in Config, how a document writes it, its canonical
// form and its default. Each kind of value (a list of CIDRs, a boolean, ...) is one
// implementation with its own decoder, so a key whose entries take another form (a mapping as
// well as a string) is a kind of its own; the rule that merges the values of several files
// belongs to the kind as well (lists concatenate, scalars must agree).
type value interface {
	typeName() string
	// decode reads the key's value from raw (never JSON null) into c. An error is a
	// *FieldError, or several joined.
	decode(key string, raw json.RawMessage, opts Options, c *Config) error
	// canonical returns the value in c as a JSON value that decode reads back.
	canonical(c *Config) any
	setDefault(c *Config, opts Options)
	// copyFrom sets the value in c to the one in from.
	copyFrom(c, from *Config)
	// merge adds the value in from (a later file's) to the one in c (the earlier files'
	// merged). A conflict leaves c as it was and tells what disagrees (see conflict).
	merge(c, from *Config) *conflict
}

// conflict is a disagreement between two files over a key.
type conflict struct {
	// Index is the entry of the merged list (-1 for a scalar) that the later file's entry
	// Entry disagrees with.
	Index, Entry int
	// Have and Got show the two values: the earlier file's and the later one's.
	Have, Got string
}

// field is a value of Go type T held in a field of Config.
type field[T any] struct {
	typ    string
	get    func(*Config) *T
	def    func(Options) T
	parse  func(key string, raw json.RawMessage, opts Options) (T, error)
	toJSON func(T) any
	// join merges a later file's value into the earlier files' merged one (see value.merge).
	join func(have, got T) (T, *conflict)
}

func (f field[T]) typeName() string                   { return f.typ }
func (f field[T]) canonical(c *Config) any            { return f.toJSON(*f.get(c)) }
func (f field[T]) setDefault(c *Config, opts Options) { *f.get(c) = f.def(opts) }
func (f field[T]) copyFrom(c, from *Config)           { *f.get(c) = *f.get(from) }

func (f field[T]) merge(c, from *Config) *conflict {
	v, conf := f.join(*f.get(c), *f.get(from))
	if conf == nil {
		*f.get(c) = v
	}
	return conf
}

func (f field[T]) decode(key string, raw json.RawMessage, opts Options, c *Config) error {
	v, err := f.parse(key, raw, opts)
	if err != nil {
		return err
	}
	*f.get(c) = v
	return nil
}

// keyNames lists the names of Keys, for messages.
func keyNames() []string {
	out := make([]string, len(Keys))
	for i, k := range Keys {
		out[i] = k.Name
	}
	return out
}

func lookupKey(name string) (Key, bool) {
	i := slices.IndexFunc(Keys, func(k Key) bool { return k.Name == name })
	if i < 0 {
		return Key{}, false
	}
	return Keys[i], true
}

// cidrs is a list of CIDRs; def gives the default list.
func cidrs(get func(*Config) *[]netip.Prefix, def func(Options) []netip.Prefix) value {
	return field[[]netip.Prefix]{typ: "list of CIDRs", get: get, def: def, parse: decodeCIDRs,
		toJSON: func(ps []netip.Prefix) any {
			// Written directly (a CIDR needs no escaping): the JSON of 100k strings through
			// encoding/json was most of a 100k config's hash. An empty list is [], not null.
			out := make(json.RawMessage, 0, 2+len(ps)*21)
			out = append(out, '[')
			for i, p := range ps {
				if i > 0 {
					out = append(out, ',')
				}
				out = append(p.AppendTo(append(out, '"')), '"')
			}
			return append(out, ']')
		}, join: concat[netip.Prefix]}
}

// concat is the merge of lists: the later file's entries are appended, but those an earlier
// file already lists. A file's own repeats stay, as they would in a single file.
func concat[E comparable](have, got []E) ([]E, *conflict) {
	out := slices.Clone(have)
	for _, e := range got {
		if !slices.Contains(have, e) {
			out = append(out, e)
		}
	}
	return out, nil
}

// same is the merge of a scalar: the files must agree.
func same[T comparable](show func(T) string) func(have, got T) (T, *conflict) {
	return func(have, got T) (T, *conflict) {
		if have != got {
			return have, &conflict{Index: -1, Entry: -1, Have: show(have), Got: show(got)}
		}
		return have, nil
	}
}

func boolean(get func(*Config) *bool, def bool) value {
	return field[bool]{typ: "bool", get: get, def: func(Options) bool { return def }, parse: decodeBool,
		toJSON: func(b bool) any { return b }, join: same(strconv.FormatBool)}
}

// count is a whole number, not negative.
func count(get func(*Config) *int, def int) value {
	return field[int]{typ: "int", get: get, def: func(Options) int { return def }, parse: decodeCount,
		toJSON: func(n int) any { return n }, join: same(strconv.Itoa)}
}

// interval is a duration of at least least.
func interval(get func(*Config) *time.Duration, def, least time.Duration) value {
	parse := func(key string, raw json.RawMessage, _ Options) (time.Duration, error) {
		return decodeInterval(key, raw, least)
	}
	return field[time.Duration]{typ: "duration", get: get, def: func(Options) time.Duration { return def },
		parse: parse, toJSON: func(d time.Duration) any { return d.String() }, join: same(time.Duration.String)}
}

// rfc1918 are the private ranges that are never masqueraded by default.
var rfc1918 = []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"}

// reservedRanges are added by --nomasq-all-reserved-ranges, as upstream does.
var reservedRanges = []string{
	"100.64.0.0/10",   // RFC 6598 shared address space
	"192.0.0.0/24",    // RFC 6890 IETF protocol assignments
	"192.0.2.0/24",    // RFC 5737 TEST-NET-1
	"192.88.99.0/24",  // RFC 7526 deprecated 6to4 relay anycast
	"198.18.0.0/15",   // RFC 2544 benchmarking
	"198.51.100.0/24", // RFC 5737 TEST-NET-2
	"203.0.113.0/24",  // RFC 5737 TEST-NET-3
	"240.0.0.0/4",     // RFC 1112 former class E
}

func defaultNonMasquerade(opts Options) []netip.Prefix {
	cidrs := rfc1918
	if opts.NoMasqAllReservedRanges {
		cidrs = append(slices.Clone(rfc1918), reservedRanges...)
	}
	out := make([]netip.Prefix, len(cidrs))
	for i, c := range cidrs {
		out[i] = netip.MustParsePrefix(c)
	}
	return out
}

func decodeCIDRs(key string, raw json.RawMessage, opts Options) ([]netip.Prefix, error) {
	var errs []error
	// A list of strings, the normal case, decodes in one pass; anything else item by item, so
	// that each wrong item is named.
	strs, plain := plainStrings(raw)
	valid := []bool(nil) // nil: every item is a string
	if !plain && json.Unmarshal(raw, &strs) != nil {
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return nil, &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be a list of CIDR strings, not " + describeJSON(raw),
				Hint: `for example ["10.0.0.0/8"]`}
		}
		strs, valid = make([]string, len(items)), make([]bool, len(items))
		for i, item := range items {
			if err := json.Unmarshal(item, &strs[i]); err != nil {
				errs = append(errs, &FieldError{Key: key, Index: i, Value: display(item), Problem: "must be a CIDR string, not " + describeJSON(item)})
				continue
			}
			valid[i] = true
		}
	}
	prefixes, perrs := parsePrefixes(key, strs, valid, opts)
	errs = append(errs, perrs...)
	// In list order, whichever way each item failed.
	slices.SortStableFunc(errs, func(a, b error) int { return indexOf(a) - indexOf(b) })
	return prefixes, errors.Join(errs...)
}

// parsePrefixes parses the CIDR strings of a list (those valid says are strings; all when nil),
// each error naming its entry.
func parsePrefixes(key string, strs []string, valid []bool, opts Options) ([]netip.Prefix, []error) {
	var errs []error
	prefixes := make([]netip.Prefix, 0, len(strs))
	for i, s := range strs {
		if valid != nil && !valid[i] {
			continue
		}
		p, err := ParseCIDR(s, opts.EnableIPv6)
		if err != nil {
			var fe *FieldError
			if errors.As(err, &fe) {
				fe.Key, fe.Index = key, i
			}
			errs = append(errs, err)
			continue
		}
		prefixes = append(prefixes, p)
	}
	return prefixes, errs
}

func indexOf(err error) int {
	var fe *FieldError
	if errors.As(err, &fe) {
		return fe.Index
	}
	return -1
}

// ParseCIDR parses one CIDR as the file and the command line accept it: canonical network
// address (no host bits), no zone, no IPv4-mapped IPv6, IPv6 only when enabled.
func ParseCIDR(s string, enableIPv6 bool) (netip.Prefix, error) {
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, &FieldError{Index: -1, Value: s, Problem: "not a CIDR",
			Hint: "write an address and a prefix length such as 10.0.0.0/8 or fd00::/8"}
	}
	if p.Addr().Is4In6() {
		return netip.Prefix{}, &FieldError{Index: -1, Value: s, Problem: "IPv4-mapped IPv6 prefixes are not supported",
			Hint: "write the IPv4 prefix itself"}
	}
	if m := p.Masked(); m != p {
		return netip.Prefix{}, &FieldError{Index: -1, Value: s, Problem: "host bits are set",
			Hint: fmt.Sprintf("did you mean %q?", m.String())}
	}
	if p.Addr().Is6() && !enableIPv6 {
		return netip.Prefix{}, &FieldError{Index: -1, Value: s, Problem: "IPv6 CIDR but IPv6 is not enabled",
			Hint: "start the agent with --enable-ipv6"}
	}
	return p, nil
}

func decodeBool(key string, raw json.RawMessage, _ Options) (bool, error) {
	var b bool
	if err := json.Unmarshal(raw, &b); err != nil {
		return false, &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be true or false, not " + describeJSON(raw)}
	}
	return b, nil
}

func decodeCount(key string, raw json.RawMessage, _ Options) (int, error) {
	var n int
	if err := json.Unmarshal(raw, &n); err != nil {
		return 0, &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be a whole number, not " + describeJSON(raw)}
	}
	if n < 0 {
		return 0, &FieldError{Key: key, Index: -1, Value: string(raw), Problem: "must not be negative"}
	}
	return n, nil
}

func decodeInterval(key string, raw json.RawMessage, least time.Duration) (time.Duration, error) {
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return 0, &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be a duration string, not " + describeJSON(raw),
			Hint: `for example "60s" or "1m30s"`}
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, &FieldError{Key: key, Index: -1, Value: s, Problem: "not a duration",
			Hint: `use a number with a unit, for example "60s" or "500ms"`}
	}
	if d <= 0 {
		return 0, &FieldError{Key: key, Index: -1, Value: s, Problem: "must be positive"}
	}
	if d < least {
		return 0, &FieldError{Key: key, Index: -1, Value: s, Problem: fmt.Sprintf("must be at least %s", least)}
	}
	return d, nil
}
