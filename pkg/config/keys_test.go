package config

import (
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
)

// Keys and Config describe the same keys: every field of Config is the value of exactly one key.
func TestKeysCoverConfig(t *testing.T) {
	def := Default(Options{})
	typ := reflect.TypeOf(def)
	if typ.NumField() != len(Keys) {
		t.Fatalf("Config has %d fields, Keys %d rows", typ.NumField(), len(Keys))
	}
	for i := range typ.NumField() {
		c := Default(Options{})
		switch f := reflect.ValueOf(&c).Elem().Field(i); v := f.Addr().Interface().(type) {
		case *bool:
			*v = !*v
		case *int:
			*v++
		case *time.Duration:
			*v += time.Second
		case *[]netip.Prefix:
			*v = append(*v, netip.MustParsePrefix("192.0.2.0/24"))
		case *[]MasqueradeCIDR:
			*v = append(*v, MasqueradeCIDR{CIDR: netip.MustParsePrefix("192.0.2.0/24")})
		case *netip.Addr:
			*v = netip.MustParseAddr("192.0.2.1")
		case *[]SourceRule:
			*v = append(*v, SourceRule{Name: "a", CIDRs: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}})
		default:
			t.Fatalf("Config.%s: a %s, which this test cannot change", typ.Field(i).Name, f.Type())
		}
		var changed []string
		for _, k := range Keys {
			if fmt.Sprint(k.canonical(&c)) != fmt.Sprint(k.canonical(&def)) {
				changed = append(changed, k.Name)
			}
		}
		if len(changed) != 1 {
			t.Errorf("Config.%s is the value of keys %q, want exactly one", typ.Field(i).Name, changed)
		}
	}
}

// The canonical form is what the config hash (the config_info metric) is made of: it must not
// change with the code's shape. A key added later comes after these.
func TestCanonicalForm(t *testing.T) {
	const want = `{"nonMasqueradeCIDRs":["10.0.0.0/8","172.16.0.0/12","192.168.0.0/16"],"masqueradeCIDRs":[],` +
		`"masqOutBound":true,"masqOutBoundIPv6":true,"masqLinkLocal":false,"masqLinkLocalIPv6":false,` +
		`"cidrLimit":64,"resyncInterval":"1m0s"`
	if got := string(Default(Options{}).Canonical()); !strings.HasPrefix(got, want) || !strings.HasSuffix(got, "}") ||
		(len(got) > len(want)+1 && got[len(want)] != ',') {
		t.Errorf("canonical form of the defaults:\n got  %s\n want %s}, or more keys after these", got, want)
	}
}

// The README's configuration table lists every key, in the order of Keys, with its type, its
// default (which the key's decoder reads back as the default) and its meaning.
func TestREADMEListsEveryKey(t *testing.T) {
	readme, err := markdown.Read("README.md")
	if err != nil {
		t.Fatal(err)
	}
	section, ok := markdown.Section(readme, "## Configuration")
	if !ok {
		t.Fatal("README has no Configuration section")
	}
	rows := markdown.Rows(section)
	if len(rows) != len(Keys) {
		t.Errorf("README lists %d keys, Keys has %d", len(rows), len(Keys))
	}
	def := string(Default(Options{}).Canonical())
	for i, k := range Keys {
		if i >= len(rows) {
			t.Errorf("README does not list %s", k.Name)
			continue
		}
		row := rows[i]
		if len(row) != 4 {
			t.Errorf("README row %q: want 4 cells: key, type, default, meaning", row)
			continue
		}
		if want := "`" + k.Name + "`"; row[0] != want {
			t.Errorf("README row %d is %s, want %s (the order of Keys)", i+1, row[0], want)
			continue
		}
		if row[1] != k.Type() || row[3] != k.Doc {
			t.Errorf("README lists %s as %q, %q; Keys says %q, %q", k.Name, row[1], row[3], k.Type(), k.Doc)
		}
		doc := k.Name + ": " + readmeValue(row[2], strings.HasPrefix(k.Type(), "list"))
		cfg, err := Parse([]byte(doc), Options{})
		if err != nil {
			t.Errorf("README's default of %s: %v", k.Name, err)
		} else if got := string(cfg.Canonical()); got != def {
			t.Errorf("README's default of %s, %s, is not the default:\n got  %s\n want %s", k.Name, row[2], got, def)
		}
	}
}

// readmeValue turns the README's default cell into a YAML value: "none", or code spans
// separated by commas, perhaps followed by a remark in parentheses.
func readmeValue(cell string, list bool) string {
	if cell == "none" && list {
		return "[]"
	}
	if cell == "none" {
		return `""`
	}
	cell, _, _ = strings.Cut(cell, " (")
	items := strings.Split(cell, ", ")
	for i := range items {
		items[i] = strings.Trim(items[i], "`")
	}
	if list {
		return "[" + strings.Join(items, ", ") + "]"
	}
	return strings.Join(items, ", ")
}
