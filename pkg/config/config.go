// Package config reads and validates the agent's configuration file (the ip-masq-agent ConfigMap).
//
// Only typed, validated values leave this package: CIDRs as netip.Prefix, durations as
// time.Duration. No raw string from the file ever reaches a command line.
package config

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"sigs.k8s.io/yaml"
)

// MinResyncInterval keeps a typo such as "1ns" from turning the resync into a busy loop.
const MinResyncInterval = 100 * time.Millisecond

// Config is a parsed and validated configuration. Each field is the value of one key (see Keys).
type Config struct {
	NonMasqueradeCIDRs    []netip.Prefix
	MasqueradeCIDRs       []MasqueradeCIDR
	MasqOutBound          bool
	MasqOutBoundIPv6      bool
	MasqLinkLocal         bool
	MasqLinkLocalIPv6     bool
	CIDRLimit             int
	ResyncInterval        time.Duration
	MasqueradeAddress     netip.Addr
	MasqueradeAddressIPv6 netip.Addr
	SourceRules           []SourceRule
}

// Options are the command-line flags that change how a file is read.
type Options struct {
	// EnableIPv6 allows IPv6 CIDRs (upstream --enable-ipv6).
	EnableIPv6 bool
	// NoMasqAllReservedRanges adds the RFC reserved ranges to the default nonMasqueradeCIDRs
	// (upstream --nomasq-all-reserved-ranges). A file that sets nonMasqueradeCIDRs overrides them.
	NoMasqAllReservedRanges bool
	// Pattern selects the files of a config directory that are merged (--config-pattern);
	// empty means DefaultPattern.
	Pattern string
}

// FilePattern is the pattern of the files of a config directory.
func (o Options) FilePattern() string {
	if o.Pattern == "" {
		return DefaultPattern
	}
	return o.Pattern
}

// Default returns the configuration in force when no file exists.
func Default(opts Options) Config {
	var c Config
	for _, k := range Keys {
		k.setDefault(&c, opts)
	}
	return c
}

// Parse reads a YAML or JSON document. A key absent from the document keeps its default; so
// does a key whose value is null (an empty YAML value). Every problem found is reported, each
// naming the key, the value and what is wrong.
func Parse(data []byte, opts Options) (Config, error) {
	cfg, _, err := parseDocument(data, opts)
	if err != nil {
		return Config{}, err
	}
	if err := cfg.validate(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// parseDocument reads a document's keys over the defaults, not yet validated together, and
// tells which keys it set (present and not null).
func parseDocument(data []byte, opts Options) (Config, map[string]bool, error) {
	cfg := Default(opts)
	doc, err := document(data)
	if err != nil {
		return Config{}, nil, err
	}
	if err := cfg.decode(doc, opts); err != nil {
		return Config{}, nil, err
	}
	set := make(map[string]bool, len(doc))
	for name, raw := range doc {
		set[name] = string(raw) != "null"
	}
	return cfg, set, nil
}

// document reads a YAML or JSON mapping into its keys' raw JSON values; an empty document, or one
// of only comments, has none.
func document(data []byte) (map[string]json.RawMessage, error) {
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, nil
	}
	if cut, lists := cutBigLists(data); lists != nil {
		if doc, js, err := documentOf(cut); err == nil && withBigLists(doc, js, lists) {
			return doc, nil
		}
	}
	doc, _, err := documentOf(data)
	return doc, err
}

// documentOf is document without the shortcut for long lists, and the JSON of the whole.
func documentOf(data []byte) (map[string]json.RawMessage, []byte, error) {
	// Strict: duplicate keys are an error rather than a silent last-one-wins.
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return nil, nil, fmt.Errorf("not valid YAML or JSON: %w", err)
	}
	if string(js) == "null" {
		return nil, js, nil // a document of only comments
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(js, &doc); err != nil {
		return nil, nil, fmt.Errorf("the document must be a mapping of keys to values, got %s", describeJSON(js))
	}
	return doc, js, nil
}

// decode sets the keys of doc in c. Every problem is reported, one FieldError each, in the
// order of the keys' names, so that the output is stable.
func (c *Config) decode(doc map[string]json.RawMessage, opts Options) error {
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(doc)) {
		key, known := lookupKey(name)
		if !known {
			errs = append(errs, unknownKey(name))
			continue
		}
		raw := doc[name]
		if string(raw) == "null" {
			continue
		}
		if err := key.decode(name, raw, opts, c); err != nil {
			errs = append(errs, flatten(err)...) // so that callers see one FieldError per problem
		}
	}
	return errors.Join(errs...)
}

// flatten returns the errors joined in err, or err alone.
func flatten(err error) []error {
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		return joined.Unwrap()
	}
	return []error{err}
}

// validate checks what involves more than one key or entry.
func (c Config) validate() error {
	return errors.Join(append(c.checks(), c.validateSourceRules()...)...)
}

// checks are validate's checks of the global keys, which validateSourceRules makes of each
// rule's keys too.
func (c Config) checks() []error {
	errs := c.validateMasqueradeCIDRs()
	if n := len(c.NonMasqueradeCIDRs); n > c.CIDRLimit {
		errs = append(errs, &FieldError{Key: KeyNonMasqueradeCIDRs, Index: -1, Value: fmt.Sprintf("%d entries", n),
			Problem: fmt.Sprintf("more than %s (%d) entries", KeyCIDRLimit, c.CIDRLimit),
			Hint:    fmt.Sprintf("raise %s to at least %d if this many is intended", KeyCIDRLimit, n)})
	}
	return errs
}

// FieldError is a validation failure of one key or one list entry.
type FieldError struct {
	Key     string
	Index   int // entry of a list key, or -1
	Value   string
	Problem string
	Hint    string
}

func (e *FieldError) Error() string {
	var b strings.Builder
	if len(e.Key) > maxQuoted || !utf8.ValidString(e.Key) {
		b.WriteString(quote(e.Key)) // an unknown key is user input too
	} else {
		b.WriteString(e.Key)
	}
	if e.Index >= 0 {
		fmt.Fprintf(&b, "[%d]", e.Index)
	}
	fmt.Fprintf(&b, ": %s: %s", quote(e.Value), e.Problem)
	if e.Hint != "" {
		b.WriteString("; " + e.Hint)
	}
	return b.String()
}

// quote bounds a user value for messages and logs: long input is cut, odd bytes escaped.
const maxQuoted = 80

func quote(s string) string {
	if len(s) > maxQuoted {
		return fmt.Sprintf("%q...", s[:maxQuoted])
	}
	return fmt.Sprintf("%q", s)
}

// display shows a JSON value as the user wrote it: strings without their JSON quotes.
func display(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	return string(raw)
}

func unknownKey(key string) error {
	fe := &FieldError{Key: key, Index: -1, Value: key, Problem: "unknown key"}
	if s := closest(key); s != "" {
		fe.Hint = fmt.Sprintf("did you mean %q?", s)
	} else {
		fe.Hint = "known keys: " + strings.Join(keyNames(), ", ")
	}
	return fe
}

// closest returns the known key nearest to key by edit distance, ignoring case, or "" when
// none is near enough to be a plausible typo.
func closest(key string) string { return closestOf(key, keyNames()) }

// closestOf returns the name nearest to key, as closest does, among names.
func closestOf(key string, names []string) string {
	best, bestDist := "", 1<<30
	lk := strings.ToLower(key)
	for _, name := range names {
		if d := editDistance(lk, strings.ToLower(name)); d < bestDist {
			best, bestDist = name, d
		}
	}
	if bestDist <= max(2, len(best)/4) {
		return best
	}
	return ""
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func describeJSON(js []byte) string {
	switch {
	case len(js) == 0:
		return "nothing"
	case js[0] == '[':
		return "a list"
	case js[0] == '{':
		return "a mapping"
	case js[0] == '"':
		return "a string"
	case js[0] == 't' || js[0] == 'f':
		return "a boolean"
	default:
		return "a number"
	}
}

// Canonical returns the configuration as a JSON document with every key, in the order of Keys.
// Equal configurations give equal bytes, so it can be hashed to identify the config in force,
// and Parse of it gives the configuration back.
func (c Config) Canonical() []byte {
	b := []byte{'{'}
	for i, k := range Keys {
		// Left out while empty, so that the configs of before source rules keep their hashes.
		if k.Name == KeySourceRules && len(c.SourceRules) == 0 {
			continue
		}
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSON(b, k.Name)
		b = append(b, ':')
		b = appendJSON(b, k.canonical(&c))
	}
	return append(b, '}')
}

func appendJSON(b []byte, v any) []byte {
	if raw, ok := v.(json.RawMessage); ok {
		return append(b, raw...)
	}
	js, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("marshal config: %v", err)) // only strings, bools, ints and raw JSON: cannot fail
	}
	return append(b, js...)
}
