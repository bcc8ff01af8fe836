package config

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// masq is masqueradeCIDRs entries without addresses.
func masq(ss ...string) []MasqueradeCIDR {
	out := make([]MasqueradeCIDR, len(ss))
	for i, p := range prefixes(ss...) {
		out[i] = MasqueradeCIDR{CIDR: p}
	}
	return out
}

func TestDefaults(t *testing.T) {
	got := Default(Options{})
	if !slices.Equal(got.NonMasqueradeCIDRs, prefixes("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")) {
		t.Errorf("nonMasqueradeCIDRs = %v", got.NonMasqueradeCIDRs)
	}
	if len(got.MasqueradeCIDRs) != 0 || !got.MasqOutBound || !got.MasqOutBoundIPv6 || got.MasqLinkLocal ||
		got.MasqLinkLocalIPv6 || got.CIDRLimit != 64 || got.ResyncInterval != 60*time.Second {
		t.Errorf("defaults = %+v", got)
	}

	reserved := Default(Options{NoMasqAllReservedRanges: true})
	want := prefixes("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24",
		"192.0.2.0/24", "192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4")
	if !slices.Equal(reserved.NonMasqueradeCIDRs, want) {
		t.Errorf("reserved ranges = %v", reserved.NonMasqueradeCIDRs)
	}
	// The defaults must not share storage: a caller editing one must not change the next.
	reserved.NonMasqueradeCIDRs[0] = netip.MustParsePrefix("1.0.0.0/8")
	if Default(Options{NoMasqAllReservedRanges: true}).NonMasqueradeCIDRs[0].String() != "10.0.0.0/8" {
		t.Error("Default returned shared storage")
	}
}

func TestParseKeepsDefaultsForAbsentKeys(t *testing.T) {
	for _, doc := range []string{"", "   \n", "# only a comment\n", "{}", "masqueradeCIDRs:\n", "masqueradeCIDRs: null"} {
		got, err := Parse([]byte(doc), Options{})
		if err != nil {
			t.Fatalf("Parse(%q): %v", doc, err)
		}
		def := Default(Options{})
		if !slices.Equal(got.NonMasqueradeCIDRs, def.NonMasqueradeCIDRs) || got.MasqOutBound != def.MasqOutBound ||
			got.ResyncInterval != def.ResyncInterval || len(got.MasqueradeCIDRs) != 0 {
			t.Errorf("Parse(%q) = %+v, want defaults", doc, got)
		}
	}
}

func TestParseEveryKey(t *testing.T) {
	yamlDoc := `
nonMasqueradeCIDRs:
  - 10.0.0.0/8
  - fc00::/7
masqueradeCIDRs: [10.10.10.10/32, "2001:db8::/32"]
masqOutBound: false
masqOutBoundIPv6: false
masqLinkLocal: true
masqLinkLocalIPv6: true
cidrLimit: 3
resyncInterval: 1m30s
`
	jsonDoc := `{"nonMasqueradeCIDRs":["10.0.0.0/8","fc00::/7"],"masqueradeCIDRs":["10.10.10.10/32","2001:db8::/32"],
"masqOutBound":false,"masqOutBoundIPv6":false,"masqLinkLocal":true,"masqLinkLocalIPv6":true,"cidrLimit":3,"resyncInterval":"90s"}`
	want := Config{
		NonMasqueradeCIDRs: prefixes("10.0.0.0/8", "fc00::/7"),
		MasqueradeCIDRs:    masq("10.10.10.10/32", "2001:db8::/32"),
		MasqLinkLocal:      true, MasqLinkLocalIPv6: true, CIDRLimit: 3, ResyncInterval: 90 * time.Second,
	}
	for name, doc := range map[string]string{"yaml": yamlDoc, "json": jsonDoc} {
		got, err := Parse([]byte(doc), Options{EnableIPv6: true})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !equal(got, want) {
			t.Errorf("%s: got %+v\nwant %+v", name, got, want)
		}
	}
}

func equal(a, b Config) bool {
	return slices.Equal(a.NonMasqueradeCIDRs, b.NonMasqueradeCIDRs) && slices.Equal(a.MasqueradeCIDRs, b.MasqueradeCIDRs) &&
		a.MasqOutBound == b.MasqOutBound && a.MasqOutBoundIPv6 == b.MasqOutBoundIPv6 && a.MasqLinkLocal == b.MasqLinkLocal &&
		a.MasqLinkLocalIPv6 == b.MasqLinkLocalIPv6 && a.CIDRLimit == b.CIDRLimit && a.ResyncInterval == b.ResyncInterval &&
		a.MasqueradeAddress == b.MasqueradeAddress && a.MasqueradeAddressIPv6 == b.MasqueradeAddressIPv6
}

func TestParseEmptyListMeansNone(t *testing.T) {
	got, err := Parse([]byte("nonMasqueradeCIDRs: []"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(got.NonMasqueradeCIDRs) != 0 {
		t.Errorf("nonMasqueradeCIDRs = %v, want none", got.NonMasqueradeCIDRs)
	}
}

func TestValidationErrors(t *testing.T) {
	tests := []struct {
		name  string
		doc   string
		opts  Options
		wants []string // substrings the message must contain
	}{
		{"unparsable CIDR", "nonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/33]",
			Options{}, []string{"nonMasqueradeCIDRs[1]", `"10.0.0.0/33"`, "not a CIDR"}},
		{"not a CIDR at all", `masqueradeCIDRs: ["bogus"]`,
			Options{}, []string{"masqueradeCIDRs[0]", `"bogus"`, "not a CIDR"}},
		{"address without length", `nonMasqueradeCIDRs: ["10.0.0.1"]`,
			Options{}, []string{"nonMasqueradeCIDRs[0]", `"10.0.0.1"`, "not a CIDR"}},
		{"host bits set", "nonMasqueradeCIDRs: [10.0.0.1/8]",
			Options{}, []string{"nonMasqueradeCIDRs[0]", `"10.0.0.1/8"`, "host bits", `did you mean "10.0.0.0/8"`}},
		{"host bits set IPv6", `masqueradeCIDRs: ["fd00::1/8"]`,
			Options{EnableIPv6: true}, []string{"masqueradeCIDRs[0]", `"fd00::1/8"`, "host bits", `"fd00::/8"`}},
		{"IPv6 without --enable-ipv6", "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]",
			Options{}, []string{"nonMasqueradeCIDRs[1]", `"fc00::/7"`, "IPv6 is not enabled", "--enable-ipv6"}},
		{"IPv6 masquerade CIDR without --enable-ipv6", `masqueradeCIDRs: ["2001:db8::/32"]`,
			Options{}, []string{"masqueradeCIDRs[0]", `"2001:db8::/32"`, "--enable-ipv6"}},
		{"IPv4-mapped IPv6", `nonMasqueradeCIDRs: ["::ffff:10.0.0.0/104"]`,
			Options{EnableIPv6: true}, []string{"nonMasqueradeCIDRs[0]", `"::ffff:10.0.0.0/104"`, "IPv4-mapped"}},
		{"zone", `nonMasqueradeCIDRs: ["fe80::%eth0/64"]`,
			Options{EnableIPv6: true}, []string{"nonMasqueradeCIDRs[0]", `"fe80::%eth0/64"`}},
		{"more CIDRs than cidrLimit", "cidrLimit: 2\nnonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16]",
			Options{}, []string{"nonMasqueradeCIDRs", "3 entries", "cidrLimit (2)", "raise cidrLimit"}},
		{"defaults over a small cidrLimit", "cidrLimit: 1",
			Options{}, []string{"nonMasqueradeCIDRs", "3 entries", "cidrLimit (1)"}},
		{"negative cidrLimit", "cidrLimit: -1",
			Options{}, []string{"cidrLimit", `"-1"`, "negative"}},
		{"cidrLimit not a number", "cidrLimit: lots",
			Options{}, []string{"cidrLimit", `"lots"`, "whole number, not a string"}},
		{"bad resyncInterval", "resyncInterval: soon",
			Options{}, []string{"resyncInterval", `"soon"`, "not a duration"}},
		{"resyncInterval without unit", `resyncInterval: "60"`,
			Options{}, []string{"resyncInterval", `"60"`, "not a duration"}},
		{"resyncInterval as a number", "resyncInterval: 60",
			Options{}, []string{"resyncInterval", `"60"`, "duration string, not a number"}},
		{"zero resyncInterval", "resyncInterval: 0s",
			Options{}, []string{"resyncInterval", `"0s"`, "must be positive"}},
		{"negative resyncInterval", "resyncInterval: -5s",
			Options{}, []string{"resyncInterval", `"-5s"`, "must be positive"}},
		{"tiny resyncInterval", "resyncInterval: 1ns",
			Options{}, []string{"resyncInterval", `"1ns"`, "at least 100ms"}},
		{"unknown key with suggestion", "nonMasqueradeCIDR: [10.0.0.0/8]",
			Options{}, []string{`"nonMasqueradeCIDR"`, "unknown key", `did you mean "nonMasqueradeCIDRs"`}},
		{"unknown key wrong case", "masqoutbound: false",
			Options{}, []string{`"masqoutbound"`, "unknown key", `did you mean "masqOutBound"`}},
		{"unknown key far from any", "snatTarget: 1.2.3.4",
			Options{}, []string{`"snatTarget"`, "unknown key", "known keys:"}},
		{"unknown key with null value", "masqLinkLocl:",
			Options{}, []string{`"masqLinkLocl"`, `did you mean "masqLinkLocal"`}},
		{"bool as string", `masqOutBound: "false"`,
			Options{}, []string{"masqOutBound", `"false"`, "true or false, not a string"}},
		{"bool as number", `masqLinkLocal: 1`,
			Options{}, []string{"masqLinkLocal", `"1"`, "true or false, not a number"}},
		{"list as string", `nonMasqueradeCIDRs: "10.0.0.0/8"`,
			Options{}, []string{"nonMasqueradeCIDRs", `"10.0.0.0/8"`, "must be a list of CIDR strings, not a string"}},
		{"list entry not a string", `nonMasqueradeCIDRs: [[10.0.0.0/8]]`,
			Options{}, []string{"nonMasqueradeCIDRs[0]", "must be a CIDR string, not a list"}},
		{"document is a list", `- 10.0.0.0/8`,
			Options{}, []string{"mapping", "a list"}},
		{"duplicate key", "masqOutBound: true\nmasqOutBound: false",
			Options{}, []string{"masqOutBound", "not valid YAML"}},
		{"broken YAML", "nonMasqueradeCIDRs: [10.0.0.0/8",
			Options{}, []string{"not valid YAML or JSON"}},
	}
	for _, tt := range tests {
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
}

func TestEveryProblemIsReported(t *testing.T) {
	_, err := Parse([]byte("nonMasqueradeCIDRs: [10.0.0.1/8, x]\nmasqOutBound: maybe\nresyncInterval: never"), Options{})
	if err == nil {
		t.Fatal("no error")
	}
	var fes []*FieldError
	for _, e := range err.(interface{ Unwrap() []error }).Unwrap() {
		var fe *FieldError
		if errors.As(e, &fe) {
			fes = append(fes, fe)
		}
	}
	if len(fes) != 4 {
		t.Errorf("got %d field errors, want 4: %v", len(fes), err)
	}
}

func TestLongValuesAreCutInMessages(t *testing.T) {
	long := strings.Repeat("9", 10000)
	_, err := Parse([]byte("nonMasqueradeCIDRs: ["+long+"]"), Options{})
	if err == nil || len(err.Error()) > 300 {
		t.Fatalf("error message not bounded: %d bytes", len(err.Error()))
	}
}

func TestLoad(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "absent")
	got, err := Load(missing, Options{})
	if err != nil || !equal(got, Default(Options{})) {
		t.Fatalf("Load(missing) = %+v, %v; want defaults", got, err)
	}

	path := filepath.Join(dir, "ip-masq-agent")
	if err := os.WriteFile(path, []byte("masqOutBound: false\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err = Load(path, Options{})
	if err != nil || got.MasqOutBound {
		t.Fatalf("Load = %+v, %v", got, err)
	}

	if err := os.WriteFile(path, []byte("masqOutBound: nope\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path, Options{}); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("Load(bad) error %v does not name the file", err)
	}

	big := make([]byte, MaxFileSize+1)
	for i := range big {
		big[i] = ' '
	}
	if err := os.WriteFile(path, big, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(path, Options{}); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("Load(huge) = %v, want a size error", err)
	}

	// A directory is read as its ip-masq* files merged: the oversized one among them.
	if _, err := Load(dir, Options{}); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("Load(directory) = %v, want the size error of its file", err)
	}
}

func TestClosest(t *testing.T) {
	for in, want := range map[string]string{
		"nonMasqueradeCIDR":  KeyNonMasqueradeCIDRs,
		"NonMasqueradeCidrs": KeyNonMasqueradeCIDRs,
		"masqueradeCIDR":     KeyMasqueradeCIDRs,
		"masqOutbound":       KeyMasqOutBound,
		"masqOutBoundIpv6":   KeyMasqOutBoundIPv6,
		"resync":             "",
		"cidrlimit":          KeyCIDRLimit,
		"resyncIntervall":    KeyResyncInterval,
		"x":                  "",
	} {
		if got := closest(in); got != want {
			t.Errorf("closest(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestReadFile: symlinks are followed (a ConfigMap's two levels of them), a missing file or a
// link to nothing is Missing, anything but a regular file is refused without being read (a
// pipe would block, a device could be endless), and a file whose content disagrees with its
// size is reported torn.
func TestReadFile(t *testing.T) {
	dir := t.TempDir()
	data := filepath.Join(dir, "..2026_01_01", "ip-masq-agent")
	if err := os.MkdirAll(filepath.Dir(data), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(data, []byte("masqOutBound: false\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("..2026_01_01", filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "ip-masq-agent")
	if err := os.Symlink(filepath.Join("..data", "ip-masq-agent"), path); err != nil {
		t.Fatal(err)
	}
	f, err := ReadFile(path)
	if err != nil || f.Missing || f.Torn || string(f.Data) != "masqOutBound: false\n" || f.ModTime.IsZero() {
		t.Fatalf("ReadFile through symlinks = %+v, %v", f, err)
	}
	if f.Published {
		t.Error("a file under ..2026_01_01 (not the kubelet's payload directory name) is reported published")
	}
	// The kubelet's layout: the payload directory is "..<timestamp>.<random digits>".
	kubelet := filepath.Join(dir, "..2026_01_01_12_30_45.123456789")
	if err := os.Mkdir(kubelet, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(kubelet, "ip-masq-agent"), []byte("masqOutBound: true\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Base(kubelet), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if f, err := ReadFile(path); err != nil || !f.Published || string(f.Data) != "masqOutBound: true\n" {
		t.Errorf("ReadFile of a ConfigMap payload = %+v, %v; want it published", f, err)
	}
	if f, err := ReadFile(filepath.Join(kubelet, "ip-masq-agent")); err != nil || f.Published {
		t.Errorf("ReadFile of the payload file itself (no symlink) = %+v, %v; want it not published", f, err)
	}

	dangling := filepath.Join(dir, "dangling")
	if err := os.Symlink(filepath.Join(dir, "nothing"), dangling); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(dir, "nothing"), dangling} {
		if f, err := ReadFile(p); err != nil || !f.Missing {
			t.Errorf("ReadFile(%s) = %+v, %v; want a missing file", p, f, err)
		}
		if cfg, err := Load(p, Options{}); err != nil || !equal(cfg, Default(Options{})) {
			t.Errorf("Load(%s) = %+v, %v; want the defaults", p, cfg, err)
		}
	}

	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for p, kind := range map[string]string{fifo: "named pipe", "/dev/zero": "character device", dir: "directory"} {
			want := fmt.Sprintf("config %s is not a regular file but a %s", p, kind)
			if _, err := ReadFile(p); err == nil || err.Error() != want {
				t.Errorf("ReadFile(%s) = %v, want %q", p, err, want)
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("ReadFile blocked on a named pipe")
	}

	// procfs files say they are empty and are not: what a file changing under the read looks like.
	if f, err := ReadFile("/proc/self/status"); err != nil || !f.Torn || len(f.Data) == 0 {
		t.Errorf("ReadFile(/proc/self/status) = torn %v, %d bytes, %v; want a torn read", f.Torn, len(f.Data), err)
	}
}
