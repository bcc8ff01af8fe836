package config

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// dirOf writes files into a fresh directory and returns it.
func dirOf(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// TestMergeRules: what each kind of key does when several files set it.
func TestMergeRules(t *testing.T) {
	for _, c := range []struct {
		name  string
		files map[string]string
		check func(Config) string // "" when right
	}{
		{"a key no file sets keeps its default", map[string]string{"ip-masq-a": "masqLinkLocal: true\n"},
			func(c Config) string {
				if !c.MasqLinkLocal || !slices.Equal(c.NonMasqueradeCIDRs, Default(Options{}).NonMasqueradeCIDRs) || c.CIDRLimit != 64 {
					return fmt.Sprintf("%+v", c)
				}
				return ""
			}},
		{"lists concatenate in name order, an earlier file's entry is not repeated", map[string]string{
			"ip-masq-b": "nonMasqueradeCIDRs: [172.16.0.0/12, 10.0.0.0/8]\nmasqueradeCIDRs: [10.10.0.0/16]\n",
			"ip-masq-a": "nonMasqueradeCIDRs: [10.0.0.0/8]\n"},
			func(c Config) string {
				if got := fmt.Sprint(c.NonMasqueradeCIDRs, c.MasqueradeCIDRs); got != "[10.0.0.0/8 172.16.0.0/12] [10.10.0.0/16]" {
					return got
				}
				return ""
			}},
		{"a file's own repeats stay, as in a single file", map[string]string{
			"ip-masq-a": "nonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8]\n", "ip-masq-b": "nonMasqueradeCIDRs: [10.0.0.0/8]\n"},
			func(c Config) string {
				if got := fmt.Sprint(c.NonMasqueradeCIDRs); got != "[10.0.0.0/8 10.0.0.0/8]" {
					return got
				}
				return ""
			}},
		{"an empty list adds nothing and still replaces the default", map[string]string{
			"ip-masq-a": "nonMasqueradeCIDRs: []\n", "ip-masq-b": "masqOutBound: false\n"},
			func(c Config) string {
				if len(c.NonMasqueradeCIDRs) != 0 || c.MasqOutBound {
					return fmt.Sprintf("%+v", c)
				}
				return ""
			}},
		{"scalars that agree, however written", map[string]string{
			"ip-masq-a": "resyncInterval: 60s\nmasqOutBound: false\n", "ip-masq-b": "resyncInterval: 1m\nmasqOutBound: false\n"},
			func(c Config) string {
				if c.ResyncInterval != time.Minute || c.MasqOutBound {
					return fmt.Sprintf("%+v", c)
				}
				return ""
			}},
		{"a null value sets nothing", map[string]string{"ip-masq-a": "masqOutBound: false\n", "ip-masq-b": "masqOutBound:\n"},
			func(c Config) string {
				if c.MasqOutBound {
					return "masqOutBound true"
				}
				return ""
			}},
		{"cidrLimit applies to the merged list, set by any file", map[string]string{
			"ip-masq-a": "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\n", "ip-masq-b": "cidrLimit: 3\nnonMasqueradeCIDRs: [192.168.0.0/16]\n"},
			func(c Config) string {
				if len(c.NonMasqueradeCIDRs) != 3 || c.CIDRLimit != 3 {
					return fmt.Sprintf("%+v", c)
				}
				return ""
			}},
		{"no file: the defaults", map[string]string{"other": "masqOutBound: false\n"},
			func(c Config) string {
				if !equal(c, Default(Options{})) {
					return fmt.Sprintf("%+v", c)
				}
				return ""
			}},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, err := Load(dirOf(t, c.files), Options{})
			if err != nil {
				t.Fatal(err)
			}
			if bad := c.check(cfg); bad != "" {
				t.Errorf("merged %v: %s", c.files, bad)
			}
		})
	}
}

// TestMergeErrors: every problem of a directory is reported, naming the files it comes from.
func TestMergeErrors(t *testing.T) {
	for _, c := range []struct {
		name  string
		files map[string]string
		wants []string
	}{
		{"booleans that disagree", map[string]string{"ip-masq-platform": "masqOutBound: true\n", "ip-masq-user": "masqOutBound: false\n"},
			[]string{`masqOutBound: "false" in ip-masq-user conflicts with "true" in ip-masq-platform`, "must agree"}},
		{"the earlier file named is the one that disagrees", map[string]string{
			"ip-masq-a": "masqLinkLocal: false\n", "ip-masq-b": "masqLinkLocal: false\n", "ip-masq-c": "masqLinkLocal: true\n"},
			[]string{`masqLinkLocal: "true" in ip-masq-c conflicts with "false" in ip-masq-a`}},
		{"numbers that disagree", map[string]string{"ip-masq-a": "cidrLimit: 10\n", "ip-masq-b": "cidrLimit: 20\n"},
			[]string{`cidrLimit: "20" in ip-masq-b conflicts with "10" in ip-masq-a`}},
		{"durations that disagree", map[string]string{"ip-masq-a": "resyncInterval: 1m\n", "ip-masq-b": "resyncInterval: 30s\n"},
			[]string{`resyncInterval: "30s" in ip-masq-b conflicts with "1m0s" in ip-masq-a`}},
		{"the merged list over cidrLimit", map[string]string{
			"ip-masq-a": "cidrLimit: 2\nnonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\n", "ip-masq-b": "nonMasqueradeCIDRs: [192.168.0.0/16]\n"},
			[]string{"merged from ip-masq-a, ip-masq-b", "nonMasqueradeCIDRs", "3 entries", "cidrLimit (2)"}},
		{"every bad file, each named", map[string]string{"ip-masq-a": "masqOutBound: maybe\n", "ip-masq-b": "nonMasqueradeCIDRs: [10.0.0.1/8]\n"},
			[]string{"ip-masq-a: masqOutBound", `"maybe"`, "ip-masq-b: nonMasqueradeCIDRs[0]", "host bits"}},
		{"a bad file among good ones", map[string]string{"ip-masq-a": "masqOutBound: false\n", "ip-masq-b": "masqOutBound: [\n"},
			[]string{"ip-masq-b", "not valid YAML"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := dirOf(t, c.files)
			_, err := Load(dir, Options{})
			if err == nil {
				t.Fatalf("merged %v without an error", c.files)
			}
			for _, w := range append(c.wants, dir) {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

// TestReadDir: which entries of a directory are read.
func TestReadDir(t *testing.T) {
	dir := dirOf(t, map[string]string{
		"ip-masq-b": "masqOutBound: false\n", "ip-masq-a": "masqLinkLocal: true\n",
		"README": "not a config", ".ip-masq-a.swp": "editor's", "..ip-masq-data": "kubelet's"})
	if err := os.Mkdir(filepath.Join(dir, "ip-masq-dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("gone", filepath.Join(dir, "ip-masq-dangling")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("ip-masq-b", filepath.Join(dir, "ip-masq-link")); err != nil {
		t.Fatal(err)
	}
	d, err := ReadDir(dir, DefaultPattern)
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(d.Names()); got != "[ip-masq-a ip-masq-b ip-masq-link]" {
		t.Errorf("read %s, want ip-masq-a, ip-masq-b and the link", got)
	}
	if got := fmt.Sprint(d.Ignored); got != "[README]" {
		t.Errorf("ignored %s, want README", got)
	}
	if d, err := ReadDir(dir, "READ*"); err != nil || fmt.Sprint(d.Names()) != "[README]" {
		t.Errorf("pattern READ*: %v, %v", d.Names(), err)
	}
	if d, err := ReadDir(filepath.Join(dir, "absent"), DefaultPattern); err != nil || len(d.Files) != 0 {
		t.Errorf("a missing directory: %+v, %v; want no files", d, err)
	}
	if cfg, err := Load(filepath.Join(dir, "absent")+"/", Options{}); err != nil || !equal(cfg, Default(Options{})) {
		t.Errorf("Load of a missing directory = %+v, %v; want the defaults", cfg, err)
	}
}

func TestCheckPattern(t *testing.T) {
	for p, ok := range map[string]bool{DefaultPattern: true, "*.yaml": true, "ip-masq-[ab]": true,
		"": false, "conf/*": false, "ip-masq-[": false} {
		if err := CheckPattern(p); (err == nil) != ok {
			t.Errorf("CheckPattern(%q) = %v", p, err)
		}
	}
}
