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
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"
	"sigs.k8s.io/yaml"
)

// DefaultPath is where the upstream DaemonSet mounts the ConfigMap.
const DefaultPath = "/etc/config/ip-masq-agent"

// MaxFileSize bounds how much of a config file is read. 100k CIDRs fit in well under this.
const MaxFileSize = 16 << 20

// MinResyncInterval keeps a typo such as "1ns" from turning the resync into a busy loop.
const MinResyncInterval = 100 * time.Millisecond

// Keys of the configuration file, as users write them.
const (
	KeyNonMasqueradeCIDRs = "nonMasqueradeCIDRs"
	KeyMasqueradeCIDRs    = "masqueradeCIDRs"
	KeyMasqOutBound       = "masqOutBound"
	KeyMasqOutBoundIPv6   = "masqOutBoundIPv6"
	KeyMasqLinkLocal      = "masqLinkLocal"
	KeyMasqLinkLocalIPv6  = "masqLinkLocalIPv6"
	KeyCIDRLimit          = "cidrLimit"
	KeyResyncInterval     = "resyncInterval"
)

// Keys lists every key the file may contain.
var Keys = []string{
	KeyNonMasqueradeCIDRs, KeyMasqueradeCIDRs, KeyMasqOutBound, KeyMasqOutBoundIPv6,
	KeyMasqLinkLocal, KeyMasqLinkLocalIPv6, KeyCIDRLimit, KeyResyncInterval,
}

// Config is a parsed and validated configuration.
type Config struct {
	NonMasqueradeCIDRs []netip.Prefix
	MasqueradeCIDRs    []netip.Prefix
	MasqOutBound       bool
	MasqOutBoundIPv6   bool
	MasqLinkLocal      bool
	MasqLinkLocalIPv6  bool
	CIDRLimit          int
	ResyncInterval     time.Duration
}

// Options are the command-line flags that change how a file is read.
type Options struct {
	// EnableIPv6 allows IPv6 CIDRs (upstream --enable-ipv6).
	EnableIPv6 bool
	// NoMasqAllReservedRanges adds the RFC reserved ranges to the default nonMasqueradeCIDRs
	// (upstream --nomasq-all-reserved-ranges). A file that sets nonMasqueradeCIDRs overrides them.
	NoMasqAllReservedRanges bool
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

// Default returns the configuration in force when no file exists.
func Default(opts Options) Config {
	cidrs := rfc1918
	if opts.NoMasqAllReservedRanges {
		cidrs = append(slices.Clone(rfc1918), reservedRanges...)
	}
	nonMasq := make([]netip.Prefix, len(cidrs))
	for i, c := range cidrs {
		nonMasq[i] = netip.MustParsePrefix(c)
	}
	return Config{
		NonMasqueradeCIDRs: nonMasq,
		MasqOutBound:       true,
		MasqOutBoundIPv6:   true,
		CIDRLimit:          64,
		ResyncInterval:     60 * time.Second,
	}
}

// Load reads the file at path. A missing file means the defaults; so does an empty one.
func Load(path string, opts Options) (Config, error) {
	f, err := ReadFile(path)
	if err != nil {
		return Config{}, err
	}
	return f.Parse(opts)
}

// File is one read of a configuration file.
type File struct {
	Path string
	Data []byte
	// Missing is true when there is no file at Path (nor at the end of its symlinks): the
	// defaults apply.
	Missing bool
	// ModTime is the file's modification time as the read ended.
	ModTime time.Time
	// Torn is true when the file changed while it was read (its size or modification time
	// differ before and after), so Data may mix two versions.
	Torn bool
	// Published is true when the path leads, through symlinks, into a directory the way the
	// kubelet publishes a ConfigMap: its files are written whole into a new "..<timestamp>"
	// directory before the "..data" link is swapped to it, and never modified there, so the
	// file cannot be half-written.
	Published bool
}

// publishedDir matches the kubelet's ConfigMap payload directories ("..2026_01_01_00_00_00.123").
var publishedDir = regexp.MustCompile(`^\.\.\d{4}_\d{2}_\d{2}_\d{2}_\d{2}_\d{2}\.\d+$`)

// ReadFile reads the file at path, following symlinks (a ConfigMap mount is symlinks through
// "..data"). Only a regular file of at most MaxFileSize bytes is read: a FIFO would block the
// reader, a device could be endless.
func ReadFile(path string) (File, error) {
	out := File{Path: path}
	// O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		out.Missing = true
		return out, nil
	}
	if err != nil {
		return out, fmt.Errorf("open config %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	before, err := f.Stat()
	if err != nil {
		return out, fmt.Errorf("stat config %s: %w", path, err)
	}
	if !before.Mode().IsRegular() {
		return out, fmt.Errorf("config %s is not a regular file but a %s", path, fileType(before.Mode()))
	}
	if before.Size() > MaxFileSize {
		return out, tooLarge(path, before.Size())
	}
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return out, fmt.Errorf("read config %s: %w", path, err)
	}
	if len(data) > MaxFileSize {
		return out, tooLarge(path, int64(len(data)))
	}
	after, err := f.Stat()
	if err != nil {
		return out, fmt.Errorf("stat config %s: %w", path, err)
	}
	out.Data, out.ModTime = data, after.ModTime()
	if real, err := filepath.EvalSymlinks(path); err == nil && real != filepath.Clean(path) {
		out.Published = publishedDir.MatchString(filepath.Base(filepath.Dir(real)))
	}
	out.Torn = before.Size() != after.Size() || !before.ModTime().Equal(after.ModTime()) ||
		int64(len(data)) != after.Size()
	return out, nil
}

func tooLarge(path string, size int64) error {
	return fmt.Errorf("config %s is larger than the limit of %d bytes (%d MiB): %d bytes", path,
		MaxFileSize, MaxFileSize>>20, size)
}

func fileType(m os.FileMode) string {
	switch {
	case m.IsDir():
		return "directory"
	case m&os.ModeNamedPipe != 0:
		return "named pipe"
	case m&os.ModeSocket != 0:
		return "socket"
	case m&os.ModeCharDevice != 0:
		return "character device"
	case m&os.ModeDevice != 0:
		return "device"
	}
	return m.Type().String()
}

// Parse parses the file's data (see Parse); a missing file gives the defaults.
func (f File) Parse(opts Options) (Config, error) {
	if f.Missing {
		return Default(opts), nil
	}
	cfg, err := Parse(f.Data, opts)
	if err != nil {
		return Config{}, fmt.Errorf("config %s: %w", f.Path, err)
	}
	return cfg, nil
}

// Parse reads a YAML or JSON document. A key absent from the document keeps its default; so
// does a key whose value is null (an empty YAML value). Every problem found is reported, each
// naming the key, the value and what is wrong.
func Parse(data []byte, opts Options) (Config, error) {
	cfg := Default(opts)
	if len(bytes.TrimSpace(data)) == 0 {
		return cfg, nil
	}
	// Strict: duplicate keys are an error rather than a silent last-one-wins.
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return Config{}, fmt.Errorf("not valid YAML or JSON: %w", err)
	}
	if string(js) == "null" {
		return cfg, nil // a document of only comments
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(js, &doc); err != nil {
		return Config{}, fmt.Errorf("the document must be a mapping of keys to values, got %s", describeJSON(js))
	}

	var errs []error
	// Sorted so that error output is stable.
	names := make([]string, 0, len(doc))
	for k := range doc {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, key := range names {
		raw := doc[key]
		if string(raw) == "null" {
			if !slices.Contains(Keys, key) {
				errs = append(errs, unknownKey(key))
			}
			continue
		}
		var err error
		switch key {
		case KeyNonMasqueradeCIDRs:
			cfg.NonMasqueradeCIDRs, err = decodeCIDRs(key, raw, opts)
		case KeyMasqueradeCIDRs:
			cfg.MasqueradeCIDRs, err = decodeCIDRs(key, raw, opts)
		case KeyMasqOutBound:
			err = decodeBool(key, raw, &cfg.MasqOutBound)
		case KeyMasqOutBoundIPv6:
			err = decodeBool(key, raw, &cfg.MasqOutBoundIPv6)
		case KeyMasqLinkLocal:
			err = decodeBool(key, raw, &cfg.MasqLinkLocal)
		case KeyMasqLinkLocalIPv6:
			err = decodeBool(key, raw, &cfg.MasqLinkLocalIPv6)
		case KeyCIDRLimit:
			err = decodeLimit(key, raw, &cfg.CIDRLimit)
		case KeyResyncInterval:
			err = decodeDuration(key, raw, &cfg.ResyncInterval)
		default:
			err = unknownKey(key)
		}
		if err != nil {
			// Flatten, so that callers see one FieldError per problem.
			if joined, ok := err.(interface{ Unwrap() []error }); ok {
				errs = append(errs, joined.Unwrap()...)
			} else {
				errs = append(errs, err)
			}
		}
	}
	if len(errs) > 0 {
		return Config{}, errors.Join(errs...)
	}
	if n := len(cfg.NonMasqueradeCIDRs); n > cfg.CIDRLimit {
		return Config{}, &FieldError{Key: KeyNonMasqueradeCIDRs, Index: -1, Value: fmt.Sprintf("%d entries", n),
			Problem: fmt.Sprintf("more than cidrLimit (%d) entries", cfg.CIDRLimit),
			Hint:    fmt.Sprintf("raise cidrLimit to at least %d if this many is intended", n)}
	}
	return cfg, nil
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

func decodeCIDRs(key string, raw json.RawMessage, opts Options) ([]netip.Prefix, error) {
	var errs []error
	// A list of strings, the normal case, decodes in one pass; anything else item by item, so
	// that each wrong item is named.
	var strs []string
	valid := []bool(nil) // nil: every item is a string
	if json.Unmarshal(raw, &strs) != nil {
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
	// In list order, whichever way each item failed.
	slices.SortStableFunc(errs, func(a, b error) int { return indexOf(a) - indexOf(b) })
	return prefixes, errors.Join(errs...)
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

func decodeBool(key string, raw json.RawMessage, dst *bool) error {
	if err := json.Unmarshal(raw, dst); err != nil {
		return &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be true or false, not " + describeJSON(raw)}
	}
	return nil
}

// display shows a JSON value as the user wrote it: strings without their JSON quotes.
func display(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	return string(raw)
}

func decodeLimit(key string, raw json.RawMessage, dst *int) error {
	var n int
	if err := json.Unmarshal(raw, &n); err != nil {
		return &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be a whole number, not " + describeJSON(raw)}
	}
	if n < 0 {
		return &FieldError{Key: key, Index: -1, Value: string(raw), Problem: "must not be negative"}
	}
	*dst = n
	return nil
}

func decodeDuration(key string, raw json.RawMessage, dst *time.Duration) error {
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return &FieldError{Key: key, Index: -1, Value: display(raw), Problem: "must be a duration string, not " + describeJSON(raw),
			Hint: `for example "60s" or "1m30s"`}
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return &FieldError{Key: key, Index: -1, Value: s, Problem: "not a duration",
			Hint: `use a number with a unit, for example "60s" or "500ms"`}
	}
	if d <= 0 {
		return &FieldError{Key: key, Index: -1, Value: s, Problem: "must be positive"}
	}
	if d < MinResyncInterval {
		return &FieldError{Key: key, Index: -1, Value: s, Problem: fmt.Sprintf("must be at least %s", MinResyncInterval)}
	}
	*dst = d
	return nil
}

func unknownKey(key string) error {
	fe := &FieldError{Key: key, Index: -1, Value: key, Problem: "unknown key"}
	if s := closest(key); s != "" {
		fe.Hint = fmt.Sprintf("did you mean %q?", s)
	} else {
		fe.Hint = "known keys: " + strings.Join(Keys, ", ")
	}
	return fe
}

// closest returns the known key nearest to key by edit distance, ignoring case, or "" when
// none is near enough to be a plausible typo.
func closest(key string) string {
	best, bestDist := "", 1<<30
	lk := strings.ToLower(key)
	for _, k := range Keys {
		if d := editDistance(lk, strings.ToLower(k)); d < bestDist {
			best, bestDist = k, d
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

// Canonical returns the configuration as a JSON document with every key, in a fixed order.
// Equal configurations give equal bytes, so it can be hashed to identify the config in force,
// and Parse of it gives the configuration back.
func (c Config) Canonical() []byte {
	strs := func(ps []netip.Prefix) []string {
		out := make([]string, len(ps))
		for i, p := range ps {
			out[i] = p.String()
		}
		return out
	}
	doc := struct {
		NonMasqueradeCIDRs []string `json:"nonMasqueradeCIDRs"`
		MasqueradeCIDRs    []string `json:"masqueradeCIDRs"`
		MasqOutBound       bool     `json:"masqOutBound"`
		MasqOutBoundIPv6   bool     `json:"masqOutBoundIPv6"`
		MasqLinkLocal      bool     `json:"masqLinkLocal"`
		MasqLinkLocalIPv6  bool     `json:"masqLinkLocalIPv6"`
		CIDRLimit          int      `json:"cidrLimit"`
		ResyncInterval     string   `json:"resyncInterval"`
	}{strs(c.NonMasqueradeCIDRs), strs(c.MasqueradeCIDRs), c.MasqOutBound, c.MasqOutBoundIPv6,
		c.MasqLinkLocal, c.MasqLinkLocalIPv6, c.CIDRLimit, c.ResyncInterval.String()}
	b, err := json.Marshal(doc)
	if err != nil {
		panic(fmt.Sprintf("marshal config: %v", err)) // only strings, bools and ints: cannot fail
	}
	return b
}
