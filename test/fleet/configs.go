// Package fleet tests the agent as a fleet against a real API server (internal/cluster): the
// configuration from the API server on several agents at once, the admission policy that
// refuses bad configurations when they are written, and the status each agent publishes.
package fleet

import (
	"fmt"
	"math/rand/v2"
	"strings"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// RandomConfigs returns n configuration documents made at random (the same seed and n give the
// same documents) from the forms people write them in, good ones and bad ones of every kind the
// agent rejects: typos in keys, CIDRs with host bits or out-of-range lengths, values of the
// wrong type, lists in block and flow form with comments, quotes and nulls, and the YAML the
// admission policy leaves to the agent (JSON, anchors, tabs, a key set twice). They drive the
// admission policy's differential test: what it refuses, the agent must refuse, with the same
// words.
func RandomConfigs(seed uint64, n int) []string {
	g := &gen{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
	out := make([]string, n)
	for i := range out {
		out[i] = g.doc()
	}
	return out
}

type gen struct{ r *rand.Rand }

func (g *gen) pick(s ...string) string { return s[g.r.IntN(len(s))] }
func (g *gen) pick2(s ...[]any) []any  { return s[g.r.IntN(len(s))] }
func (g *gen) chance(p float64) bool   { return g.r.Float64() < p }

func (g *gen) doc() string {
	var b strings.Builder
	n := g.r.IntN(5)
	keys := make([]string, 0, n)
	for range n {
		keys = append(keys, g.key())
	}
	if n > 0 && g.chance(0.05) {
		keys = append(keys, keys[0]) // a key set twice
	}
	for _, k := range keys {
		if g.chance(0.15) {
			b.WriteString(g.pick("# a comment\n", "\n", "# nonMasqueradeCIDRs: [10.0.0.1/8]\n", "#- 10.0.0.1/8\n"))
		}
		b.WriteString(g.entry(k))
	}
	doc := b.String()
	switch {
	case g.chance(0.04):
		doc = strings.ReplaceAll(doc, "\n", "\r\n")
	case g.chance(0.03):
		doc = strings.Replace(doc, "  ", "\t", 1)
	case g.chance(0.03):
		doc = "---\n" + doc
	case g.chance(0.03):
		doc = strings.Replace(doc, ": [", ": &a [", 1)
	}
	return doc
}

func (g *gen) key() string {
	k := config.Keys[g.r.IntN(len(config.Keys))].Name
	if !g.chance(0.15) {
		return k
	}
	switch g.r.IntN(6) {
	case 0:
		return strings.ToLower(k)
	case 1:
		return k[:len(k)-1]
	case 2:
		return k + g.pick("s", "x", "IP", "es")
	case 3:
		i := g.r.IntN(len(k) - 1)
		return k[:i] + string(k[i+1]) + string(k[i]) + k[i+2:]
	case 4:
		return k[:len(k)-2] + g.pick("er", "ed")
	}
	return g.pick("foo", "snatTarget", "masq-out-bound", "enableIPv6", "x")
}

func (g *gen) entry(k string) string {
	switch k {
	case config.KeyNonMasqueradeCIDRs, config.KeyMasqueradeCIDRs:
		return k + g.pick(":", ":", " :") + g.list(k == config.KeyMasqueradeCIDRs)
	case config.KeyCIDRLimit:
		return k + ": " + g.pick("0", "1", "2", "3", "64", "-1", "lots", "0x10", "1e2", "017", "", "null", `"5"`) + "\n"
	case config.KeyResyncInterval:
		return k + ": " + g.pick("60s", "1m30s", "soon", "60", `"60"`, "1ns", "0s", "-5s", "") + "\n"
	case config.KeyMasqueradeAddress, config.KeyMasqueradeAddressIPv6:
		return k + ": " + g.pick("10.0.0.11", `"2001:db8::11"`, "bogus", "127.0.0.1", "10.0.0.11/32", "12") + "\n"
	case config.KeyMasqOutBound, config.KeyMasqOutBoundIPv6, config.KeyMasqLinkLocal, config.KeyMasqLinkLocalIPv6:
		return k + ": " + g.pick("true", "false", "yes", "off", `"false"`, "1", "maybe", "") + g.comment() + "\n"
	case config.KeySourceRules:
		// The ConfigMap policy reads no rules: any, good or bad, in flow or block form.
		rules := make([]string, 1+g.r.IntN(2))
		for i := range rules {
			rules[i] = g.pick("{name: a, cidrs: [10.0.0.0/8]}", "{name: b, podSelector: {matchLabels: {a: b}}, masqOutBound: false}",
				"{cidrs: [10.0.0.1/8]}", "{name: a, masqOutBund: true}", "{name: c, nonMasqueradeCIDRs: [10.0.0.1/8], cidrs: [10.1.0.0/16]}")
		}
		if g.chance(0.5) {
			return k + ": [" + strings.Join(rules, ", ") + "]" + g.comment() + "\n"
		}
		var b strings.Builder
		b.WriteString(k + ":\n")
		for _, r := range rules {
			// A flow mapping's fields as block lines under "- ".
			fields := strings.Split(strings.TrimSuffix(strings.TrimPrefix(r, "{"), "}"), ", ")
			for i, f := range fields {
				if i == 0 {
					b.WriteString("- " + f + "\n")
				} else {
					b.WriteString("  " + f + "\n")
				}
			}
		}
		return b.String()
	}
	return k + ": " + g.pick("1", "true", "10.0.0.0/8", "[10.0.0.0/8]", "") + "\n"
}

func (g *gen) comment() string {
	if g.chance(0.2) {
		return g.pick(" # why", " # 10.0.0.1/8", "  #x")
	}
	return ""
}

// list is a list key's value: block, flow, null or a scalar, of entries of every kind.
func (g *gen) list(masq bool) string {
	n := g.r.IntN(6)
	entries := make([]string, n)
	for i := range entries {
		entries[i] = g.cidr(masq)
	}
	switch g.r.IntN(8) {
	case 0:
		return " " + g.pick("null", "~", "", `"10.0.0.0/8"`, "10.0.0.0/8", "{cidr: 10.0.0.0/8}") + "\n"
	case 1, 2, 3:
		var b strings.Builder
		b.WriteString(g.comment() + "\n")
		indent := g.pick("", "  ", "    ")
		for _, e := range entries {
			if g.chance(0.1) {
				b.WriteString(indent + "# skipped\n")
			}
			if strings.HasPrefix(e, "cidr: ") && g.chance(0.5) {
				b.WriteString(indent + "- " + e + "\n" + indent + "  address: 10.0.0.11\n")
				continue
			}
			b.WriteString(indent + "-" + g.pick(" ", " ", "  ") + e + g.comment() + "\n")
		}
		return b.String()
	}
	flow := make([]string, 0, n)
	for _, e := range entries {
		if strings.HasPrefix(e, "cidr: ") {
			e = "{" + e + "}"
		}
		flow = append(flow, e)
	}
	sep := g.pick(", ", ",", " , ")
	tail := ""
	if n > 0 && g.chance(0.15) {
		tail = g.pick(",", ", ", ",,")
	}
	return " [" + strings.Join(flow, sep) + tail + "]" + g.comment() + "\n"
}

// cidr is one list entry: good CIDRs of both families most often, and every wrong kind.
func (g *gen) cidr(masq bool) string {
	v4 := fmt.Sprintf("%d.%d.%d.%d", 1+g.r.IntN(223), g.r.IntN(256), g.r.IntN(256), g.r.IntN(256))
	bits := g.r.IntN(33)
	good := []string{"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fd00::/8", "2001:db8::/32", "169.254.0.0/16"}
	var e string
	switch g.r.IntN(12) {
	case 0, 1, 2, 3:
		e = good[g.r.IntN(len(good))]
	case 4:
		e = fmt.Sprintf("%s/%d", v4, bits) // host bits, usually
	case 5:
		e = g.pick("10.0.0.0/33", "10.0.0.1", "10.0.0/8", "bogus", "300.1.1.1/8", "fd00::1/8", "fd00::/129", "::ffff:10.0.0.0/104", "fe80::%eth0/64", "10.0.0.0/08")
	case 6:
		e = g.pick("10", "yes", "true", "null", "1e3", "0x10", "1:20", "-", "[10.0.0.0/8]")
	case 7:
		e = `"` + good[g.r.IntN(len(good))] + `"`
	case 8:
		e = `'` + fmt.Sprintf("%s/%d", v4, bits) + `'`
	case 9:
		e = "FD00::/8"
	default:
		e = fmt.Sprintf("%s/%d", v4, 32)
	}
	if masq && g.chance(0.3) {
		return "cidr: " + strings.Trim(e, `"'`)
	}
	return e
}

// RandomRuleSpecs returns n IPMasqAgentConfig specs made at random (the same seed and n give
// the same specs) whose source rules hold every kind of mistake the agent rejects in a rule,
// and good rules: names missing, bad or repeated; CIDRs with host bits or of IPv6; unknown
// keys; label selectors with unknown fields, operators without the values they need or with
// values they take none of, label keys that are no labels; rules without sources. They drive
// the IPMasqAgentConfig policy's differential test.
func RandomRuleSpecs(seed uint64, n int) []map[string]any {
	g := &gen{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
	out := make([]map[string]any, n)
	for i := range out {
		spec := map[string]any{}
		if g.chance(0.2) {
			spec[config.KeyNonMasqueradeCIDRs] = []any{g.pick("10.0.0.0/8", "10.0.0.1/8")}
		}
		rules := make([]any, 1+g.r.IntN(3))
		for j := range rules {
			rules[j] = g.rule(j)
		}
		spec[config.KeySourceRules] = rules
		out[i] = spec
	}
	return out
}

// rule is the j-th rule of a list: of a name of its own but now and then.
func (g *gen) rule(j int) map[string]any {
	r := map[string]any{}
	switch g.r.IntN(30) {
	case 0:
	case 1:
		r["name"] = g.pick("Batch", "a_b", "-a")
	case 2, 3:
		r["name"] = g.pick("a", "batch")
	default:
		r["name"] = fmt.Sprintf("%s-%d", g.pick("a", "batch", "partner"), j)
	}
	for !g.chance(0.1) && r["cidrs"] == nil && r["namespaceSelector"] == nil && r["podSelector"] == nil {
		if g.chance(0.6) {
			r["cidrs"] = g.cidrs()
		}
		for _, k := range []string{"namespaceSelector", "podSelector"} {
			if g.chance(0.35) {
				r[k] = g.selector()
			}
		}
	}
	for _, k := range config.RuleKeys {
		if !g.chance(0.15) {
			continue
		}
		switch k {
		case config.KeyNonMasqueradeCIDRs:
			r[k] = g.cidrs()
		case config.KeyMasqueradeCIDRs:
			r[k] = []any{g.pick("10.0.0.0/8", "10.0.0.0/8", "10.0.0.1/8"), map[string]any{"cidr": g.pick("10.10.10.10/32", "10.10.10.10/32", "10.10.10.10/8"), "address": "10.0.0.11"}}
		case config.KeyMasqueradeAddress:
			r[k] = g.pick("10.0.0.11", "10.0.0.11", "2001:db8::11", "bogus")
		case config.KeyMasqueradeAddressIPv6:
			r[k] = g.pick("2001:db8::11", "2001:db8::11", "10.0.0.11")
		default:
			r[k] = g.chance(0.5)
		}
	}
	if g.chance(0.05) {
		r[g.pick("masqOutBund", "cidr", "Name", "podselector", "cidrLimit", "snatTarget", "masqueradeCIDR")] = g.pick("x", "10.0.0.0/8")
	}
	return r
}

func (g *gen) cidrs() []any {
	out := make([]any, g.r.IntN(3))
	for i := range out {
		out[i] = g.pick("10.0.0.0/8", "10.244.8.0/21", "192.168.0.0/16", "10.1.0.0/16", "fd00::/8")
		if g.chance(0.1) {
			out[i] = g.pick("10.0.0.1/8", "bogus", "::ffff:10.0.0.0/104", "10.0.0.0/33")
		}
	}
	return out
}

func (g *gen) selector() map[string]any {
	s := map[string]any{}
	if g.chance(0.5) {
		s["matchLabels"] = map[string]any{g.pick("team", "app.kubernetes.io/name", "tier", "team", "a b"): g.pick("batch", "web", "jobs", "batch", "x y")}
	}
	if g.chance(0.6) {
		exprs := make([]any, 1+g.r.IntN(2))
		for i := range exprs {
			e := map[string]any{"key": g.pick("tier", "canary", "example.com/tier", "tier", "a b"), "operator": g.pick("In", "NotIn", "Exists", "DoesNotExist")}
			switch op := e["operator"].(string); {
			case g.chance(0.1):
				e["values"] = g.pick2([]any{"jobs"}, []any{}, []any{"x y"})
			case op == "In" || op == "NotIn":
				e["values"] = []any{"jobs", "batch"}
			}
			if g.chance(0.05) {
				e["value"] = []any{"jobs"}
			}
			exprs[i] = e
		}
		s["matchExpressions"] = exprs
	}
	if g.chance(0.05) {
		s[g.pick("matchLabel", "matchlabels", "labels")] = map[string]any{"a": "b"}
	}
	return s
}
