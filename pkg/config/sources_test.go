package config

import (
	"strings"
	"testing"
)

func TestSourceRulesParse(t *testing.T) {
	cfg, err := Parse([]byte(`
nonMasqueradeCIDRs: [10.0.0.0/8]
sourceRules:
- name: batch
  cidrs: [10.244.8.0/21]
  namespaceSelector: {matchLabels: {team: batch}}
  podSelector: {matchExpressions: [{key: tier, operator: In, values: [jobs]}]}
  masqOutBound: false
  masqueradeCIDRs: [{cidr: 10.10.10.10/32, address: 10.0.0.11}]
`), Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := cfg.SourceRules[0]
	if r.Name != "batch" || len(r.CIDRs) != 1 || !r.Selects() || strings.Join(r.Set, ",") != "masqueradeCIDRs,masqOutBound" {
		t.Fatalf("rule %+v", r)
	}
	eff := r.Effective(cfg)
	if eff.MasqOutBound || len(eff.NonMasqueradeCIDRs) != 1 || len(eff.MasqueradeCIDRs) != 1 || eff.SourceRules != nil {
		t.Errorf("effective config %+v", eff)
	}
	ns, pods := r.Selectors()
	if !ns.Matches(labelSet{"team": "batch"}) || ns.Matches(labelSet{"team": "web"}) || !pods.Matches(labelSet{"tier": "jobs"}) {
		t.Errorf("selectors %v %v", ns, pods)
	}
	if got := cfg.SelectorRules(); len(got) != 1 || got[0] != "batch" {
		t.Errorf("SelectorRules() = %v", got)
	}
	// The canonical form reads back, and a config without rules keeps the form it had before
	// source rules.
	again, err := Parse(cfg.Canonical(), Options{})
	if err != nil || string(again.Canonical()) != string(cfg.Canonical()) {
		t.Errorf("canonical form %s reads back as %s, %v", cfg.Canonical(), again.Canonical(), err)
	}
	if strings.Contains(string(Default(Options{}).Canonical()), KeySourceRules) {
		t.Errorf("the defaults' canonical form names %s", KeySourceRules)
	}
}

type labelSet map[string]string

func (l labelSet) Has(k string) bool              { _, ok := l[k]; return ok }
func (l labelSet) Get(k string) string            { return l[k] }
func (l labelSet) Lookup(k string) (string, bool) { v, ok := l[k]; return v, ok }

// Every problem of a rule is named by the rule and the field.
func TestSourceRulesInvalid(t *testing.T) {
	for _, c := range []struct{ doc, want string }{
		{`sourceRules: {name: a}`, `sourceRules: "{\"name\":\"a\"}": must be a list of rules`},
		{`sourceRules: [{cidrs: [10.0.0.0/8]}]`, `sourceRules[0]: "{\"cidrs\":[\"10.0.0.0/8\"]}": a rule without a name`},
		{`sourceRules: [{name: Batch, cidrs: [10.0.0.0/8]}]`, `sourceRules[0].name: "Batch": must be at most 40 lower-case`},
		{`sourceRules: [{name: a}]`, `sourceRules[0](a): "{\"name\":\"a\"}": a rule without sources`},
		{`sourceRules: [{name: a, cidrs: [10.0.0.1/8]}]`, `sourceRules[0](a).cidrs[0]: "10.0.0.1/8": host bits are set`},
		{`sourceRules: [{name: a, cidrs: [10.0.0.0/8], masqOutBund: false}]`, `sourceRules[0](a).masqOutBund: "masqOutBund": unknown key of a source rule; did you mean "masqOutBound"?`},
		{`sourceRules: [{name: a, cidrs: [10.0.0.0/8], cidrLimit: 3}]`, `sourceRules[0](a).cidrLimit: "cidrLimit": unknown key of a source rule`},
		{`sourceRules: [{name: a, podSelector: {matchLabels: {"a b": c}}}]`, `sourceRules[0](a).podSelector: "{\"matchLabels\":{\"a b\":\"c\"}}": not a valid label selector`},
		{`sourceRules: [{name: a, podSelector: {matchLabel: {a: b}}}]`, `sourceRules[0](a).podSelector: "{\"matchLabel\":{\"a\":\"b\"}}": not a label selector`},
		{`sourceRules: [{name: a, cidrs: [10.0.0.0/8]}, {name: a, cidrs: [10.1.0.0/16]}]`, `sourceRules[1](a): "a": the name of sourceRules[0](a) too`},
		{"cidrLimit: 1\nsourceRules: [{name: a, cidrs: [10.0.0.0/8], nonMasqueradeCIDRs: [10.0.0.0/8, 10.1.0.0/16]}]", `sourceRules[0](a).nonMasqueradeCIDRs: "2 entries": more than cidrLimit (1) entries`},
		{`sourceRules: [{name: a, cidrs: [10.0.0.0/8], masqueradeAddress: 2001:db8::1}]`, `sourceRules[0](a).masqueradeAddress: "2001:db8::1": an IPv6 address where an IPv4 one belongs`},
		{`sourceRules: [{name: a, cidrs: [fd00::/8]}]`, `sourceRules[0](a).cidrs[0]: "fd00::/8": IPv6 CIDR but IPv6 is not enabled`},
		{"masqueradeAddress: 10.0.0.11\nsourceRules: [{name: a, cidrs: [10.0.0.0/8], masqueradeAddress: \"\"}]",
			`sourceRules[0](a).masqueradeAddress: "": the uplink's primary address, while the global masqueradeAddress is 10.0.0.11`},
	} {
		_, err := Parse([]byte(c.doc), Options{})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want %s", c.doc, err, c.want)
		}
	}
}

// The files of a directory add their rules; the same rule twice is one, and two rules of one
// name that differ are a conflict naming both files.
func TestSourceRulesMerge(t *testing.T) {
	d := Dir{Path: "/d", Files: []File{
		{Path: "/d/ip-masq-a", Data: []byte("sourceRules: [{name: a, cidrs: [10.1.0.0/16]}]")},
		{Path: "/d/ip-masq-b", Data: []byte("sourceRules: [{name: a, cidrs: [10.1.0.0/16]}, {name: b, cidrs: [10.2.0.0/16]}]")},
	}}
	cfg, err := d.Parse(Options{})
	if err != nil || len(cfg.SourceRules) != 2 || cfg.SourceRules[1].Name != "b" {
		t.Fatalf("merged %+v, %v", cfg.SourceRules, err)
	}
	d.Files = append(d.Files, File{Path: "/d/ip-masq-c", Data: []byte("sourceRules: [{name: b, cidrs: [10.3.0.0/16]}]")})
	_, err = d.Parse(Options{})
	if err == nil || !strings.Contains(err.Error(), "sourceRules[0]") || !strings.Contains(err.Error(), "ip-masq-b") ||
		!strings.Contains(err.Error(), "ip-masq-c") {
		t.Errorf("conflicting rules: %v", err)
	}
}
