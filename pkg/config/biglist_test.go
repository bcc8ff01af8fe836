package config

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

// items is n sequence items of /24s at indent, one a line.
func items(indent string, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "%s- 11.%d.%d.0/24\n", indent, i/256, i%256)
	}
	return b.String()
}

// TestBigListsReadAsTheLibraryReads compares document, with its shortcut for long lists, with
// the library's reading of the whole document, on documents whose long lists it takes out and
// on documents built to look like it could where it must not.
func TestBigListsReadAsTheLibraryReads(t *testing.T) {
	list := items("  ", minBigList+10)
	v6 := strings.ReplaceAll(strings.ReplaceAll(list, "11.", "fd00:"), ".0/24", "::/64")
	for _, tc := range []struct {
		name string
		doc  string
		cut  bool // the shortcut applies
	}{
		{"list", "cidrLimit: 1000\nnonMasqueradeCIDRs:\n" + list, true},
		{"unindented items", "nonMasqueradeCIDRs:\n" + items("", minBigList), true},
		{"keys after", "nonMasqueradeCIDRs:\n" + list + "masqLinkLocal: true\ncidrLimit: 1000\n", true},
		{"comment after", "nonMasqueradeCIDRs:\n" + list + "# the end\ncidrLimit: 1000\n", true},
		{"no final newline", "nonMasqueradeCIDRs:\n" + strings.TrimSuffix(list, "\n"), true},
		{"ipv6", "nonMasqueradeCIDRs:\n" + v6, true},
		{"two lists", "nonMasqueradeCIDRs:\n" + list + "other:\n" + v6, true},
		{"bad CIDRs", "nonMasqueradeCIDRs:\n" + strings.ReplaceAll(list, "/24", "/99"), true},
		{"duplicate key", "nonMasqueradeCIDRs:\n" + list + "nonMasqueradeCIDRs:\n" + list, false},
		{"duplicate key written otherwise", "nonMasqueradeCIDRs:\n" + list + "\"nonMasqueradeCIDRs\": []\n", false},
		{"syntax error after", "nonMasqueradeCIDRs:\n" + list + "a: [\n", false},
		{"document end after", "nonMasqueradeCIDRs:\n" + list + "...\n", true},
		{"last item continued", "nonMasqueradeCIDRs:\n" + list + "    more\n", false},
		{"blank line then continued", "nonMasqueradeCIDRs:\n" + list + "\n    more\n", false},
		{"item with comment", "nonMasqueradeCIDRs:\n" + list + "  - 10.0.0.0/8 # x\n", false},
		{"other item after", "nonMasqueradeCIDRs:\n" + list + "  - 10.0.0.0/8:\n", false},
		{"mapping item after", "nonMasqueradeCIDRs:\n" + list + "  - a: 1\n", false},
		{"inside a quoted string", "a: \"x\nnonMasqueradeCIDRs:\n" + list + "y\"\nnonMasqueradeCIDRs:\n", false},
		{"inside a flow mapping", "{\nnonMasqueradeCIDRs:\n" + list + "}\n", false},
		{"inside a nested flow mapping", "a: {\nnonMasqueradeCIDRs:\n" + list + "}\nnonMasqueradeCIDRs:\n", false},
		{"key that reads as a boolean", "yes:\n" + list, false},
		{"not a mapping", "- a\nnonMasqueradeCIDRs:\n" + list, false},
		{"second document", "a: 1\n---\nnonMasqueradeCIDRs:\n" + list, false},
		{"marker in the document", "a: fe:ed::0:0/1000\nnonMasqueradeCIDRs:\n" + list, true},
		{"short list", "nonMasqueradeCIDRs:\n" + items("  ", minBigList-1), false},
		{"crlf", strings.ReplaceAll("nonMasqueradeCIDRs:\n"+list, "\n", "\r\n"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			data := []byte(tc.doc)
			got, gotErr := document(data)
			want, _, wantErr := documentOf(data)
			if fmt.Sprint(gotErr) != fmt.Sprint(wantErr) {
				t.Fatalf("error %v, the library's %v", gotErr, wantErr)
			}
			if !reflect.DeepEqual(compact(t, got), compact(t, want)) {
				t.Fatalf("read %.200v\nthe library %.200v", compact(t, got), compact(t, want))
			}
			cutData, lists := cutBigLists(data)
			doc, js, err := documentOf(cutData)
			if cut := lists != nil && err == nil && withBigLists(doc, js, lists); cut != tc.cut {
				t.Errorf("shortcut taken: %v, want %v", cut, tc.cut)
			}
		})
	}
}

// compact is doc's values as compact JSON strings, so that equal values compare equal.
func compact(t *testing.T, doc map[string]json.RawMessage) map[string]string {
	t.Helper()
	out := map[string]string{}
	for k, v := range doc {
		var x any
		if err := json.Unmarshal(v, &x); err != nil {
			t.Fatalf("%s: %v", k, err)
		}
		js, _ := json.Marshal(x)
		out[k] = string(js)
	}
	return out
}

func TestPlainStringsReadAsJSONDoes(t *testing.T) {
	for _, raw := range []string{
		`[]`, `["a"]`, `["10.0.0.0/8","fd00::/8"]`, `[""]`, `["a",]`, `["a",,"b"]`, `[,]`, `["a"`,
		`"a"`, `[1]`, `["a",1]`, `["a\"b"]`, `["a\u0041"]`, `["é"]`, `[ "a" ]`, `["a","b" ]`, `[null]`,
		"[\"\x01\"]", `["a"]x`, `[`, `]`,
	} {
		strs, ok := plainStrings([]byte(raw))
		var want []string
		err := json.Unmarshal([]byte(raw), &want)
		if ok && (err != nil || !reflect.DeepEqual(strs, want) && !(len(strs) == 0 && len(want) == 0)) {
			t.Errorf("%s: read %q, encoding/json %q (%v)", raw, strs, want, err)
		}
		if !ok && err == nil && !strings.ContainsAny(raw, `\ é`) && raw != "[\"\x01\"]" && !strings.Contains(raw, "null") {
			t.Errorf("%s: refused a plain list of strings", raw)
		}
	}
	if _, ok := plainStrings([]byte(`["10.0.0.0/8","fd00::/8"]`)); !ok {
		t.Error("refused a list of CIDRs")
	}
}

// The canonical form of a list of CIDRs is written directly, byte for byte what encoding/json
// makes of their strings: the hash of a configuration stays what it was.
func TestCanonicalCIDRsAsEncodingJSON(t *testing.T) {
	for _, list := range [][]string{nil, {"10.0.0.0/8"}, {"10.0.0.0/8", "fd00::/8", "2001:db8::/128", "0.0.0.0/0", "::/0"}} {
		cfg := Default(Options{EnableIPv6: true})
		cfg.NonMasqueradeCIDRs = nil
		strs := []string{}
		for _, s := range list {
			cfg.NonMasqueradeCIDRs = append(cfg.NonMasqueradeCIDRs, netip.MustParsePrefix(s))
			strs = append(strs, s)
		}
		want, _ := json.Marshal(strs)
		var doc map[string]json.RawMessage
		if err := json.Unmarshal(cfg.Canonical(), &doc); err != nil {
			t.Fatal(err)
		}
		if got := doc[KeyNonMasqueradeCIDRs]; string(got) != string(want) {
			t.Errorf("%v: canonical %s, want %s", list, got, want)
		}
	}
}
